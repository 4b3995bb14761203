# The GPU engine worker: ExLlamaV3 1.6.5 on CUDA 13.0, with its CUDA extension compiled
# into the image.
#
# Versions that must agree (tests/unit/engine_worker/exllamav3/test_worker_image.py checks
# them against pyproject.toml):
# - torch 2.13.0, the version pyproject.toml pins: its PyPI wheel for Linux is built for
#   CUDA 13.0 (it depends on cuda-toolkit 13.0.x), so the base is CUDA 13.0's devel image,
#   whose nvcc compiles the extension (torch.utils.cpp_extension refuses an nvcc of another
#   major version than torch's CUDA);
# - exllamav3 1.6.5, transformers and tqdm, each within pyproject.toml's exllamav3 extra.
#
# The exllamav3 wheel holds no compiled extension: its first import compiles ~180 CUDA files
# (exllamav3/ext.py, torch.utils.cpp_extension.load), minutes per GPU architecture. That
# happens here, once, for TORCH_CUDA_ARCH_LIST (a build argument: list the GPUs you run on).
# No GPU is needed: the architectures come from the list, not from a device. The library it
# builds is then installed as the module exllamav3_ext, which exllamav3 imports instead of
# compiling when it finds one (ext.py:21-31): a container start neither compiles nor writes
# anything, so it runs as a non-root user on a read-only root filesystem, and
# TORCH_EXTENSIONS_DIR is not used at run time.
#
#   docker build -f deploy/docker/worker-exllamav3.Dockerfile \
#       --build-arg TORCH_CUDA_ARCH_LIST="8.9;9.0" --build-arg MAX_JOBS=16 -t exl3-worker .
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04
FROM ${CUDA_IMAGE}
# Ampere, Ada, Hopper, Blackwell (data center and consumer), plus PTX for later GPUs.
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0;10.0;12.0+PTX"
# Parallel nvcc jobs; each can take several GB of memory.
ARG MAX_JOBS=8
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ninja-build \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    HF_HUB_OFFLINE=1
WORKDIR /app
# torch first: exllamav3 deliberately does not depend on a torch build.
RUN pip install --no-cache-dir torch==2.13.0
COPY pyproject.toml README.md ./
# The worker's own package and the contract only: no proxy code in a worker image.
COPY protocol ./protocol
COPY engine_worker ./engine_worker
RUN pip install --no-cache-dir ".[exllamav3]" torch==2.13.0 exllamav3==1.6.5 transformers==5.24.0 tqdm==4.70.1
# The import is the build (importing the rest of exllamav3 may need a GPU: the library is
# what this step must leave behind). Then the library becomes the precompiled module, the
# build folder goes, and a fresh import must find the module.
RUN export TORCH_EXTENSIONS_DIR=/tmp/exllamav3-build MAX_JOBS=${MAX_JOBS}; \
    python -c "import exllamav3.ext" || echo "import after the build failed (no GPU here)"; \
    so=$(ls "$TORCH_EXTENSIONS_DIR"/exllamav3_ext/exllamav3_ext*.so | head -n 1) \
    && cp "$so" "$(python -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/exllamav3_ext.so" \
    && rm -rf "$TORCH_EXTENSIONS_DIR" \
    && python -c "import torch, exllamav3_ext"
ENTRYPOINT ["python", "-m", "engine_worker", "--backend", "exllamav3"]
