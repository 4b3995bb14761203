# The GPU engine worker: ExLlamaV3 1.6.5 on CUDA 13.0, with its CUDA extension compiled
# into the image.
#
# Versions that must agree (tests/unit/engine_worker/exllamav3/test_worker_image.py checks
# them against pyproject.toml and the lock):
# - torch 2.13.0, the version pyproject.toml pins: its PyPI wheel for Linux is built for
#   CUDA 13.0 (it depends on cuda-toolkit 13.0.x), so the build stage is CUDA 13.0's devel
#   image, whose nvcc compiles the extension (torch.utils.cpp_extension refuses an nvcc of
#   another major version than torch's CUDA);
# - exllamav3 1.6.5, transformers and tqdm, each within pyproject.toml's exllamav3 extra,
#   all from deploy/docker/locks/worker-exllamav3.txt (hashes checked).
#
# The exllamav3 wheel holds no compiled extension: its first import compiles its CUDA sources
# (exllamav3/ext.py, torch.utils.cpp_extension.load), minutes per GPU architecture. That
# happens in the build stage, once, for TORCH_CUDA_ARCH_LIST (a build argument: list the
# GPUs you run on). No GPU is needed: the architectures come from the list, not from a
# device. The library it builds is then installed as the module exllamav3_ext, which
# exllamav3 imports instead of compiling when it finds one (ext.py:21-31).
#
# Two stages: the runtime stage is CUDA's "base" image (the CUDA runtime and the variables
# the NVIDIA container toolkit reads), not the devel one: torch's wheels bring the CUDA
# libraries it loads, and nvcc, headers and static libraries stay behind. What stays is a C
# compiler and Python's headers: Triton (torch's dependency, which exllamav3's attention
# kernels run on) compiles each kernel's small C launcher with the system's cc at run time
# (triton/runtime/build.py) and its kernels into TRITON_CACHE_DIR, an emptyDir in the pod.
#
# Source last: a change to engine_worker/ or protocol/ rebuilds only the final COPY and
# `pip install --no-deps .` (seconds), never the dependencies or the extension.
#
#   docker build -f deploy/docker/worker-exllamav3.Dockerfile \
#       --build-arg CUDA_DEVEL_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04@sha256:<digest> \
#       --build-arg CUDA_RUNTIME_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04@sha256:<digest> \
#       --build-arg TORCH_CUDA_ARCH_LIST="8.9;9.0" --build-arg MAX_JOBS=16 -t exl3-worker .
ARG CUDA_DEVEL_IMAGE
ARG CUDA_RUNTIME_IMAGE

FROM ${CUDA_DEVEL_IMAGE} AS build
# Ampere, Ada, Hopper, Blackwell (data center and consumer), plus PTX for later GPUs.
ARG TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0;10.0;12.0+PTX"
# Parallel nvcc jobs; each can take several GB of memory.
ARG MAX_JOBS=8
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential ninja-build \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}
COPY deploy/docker/locks/worker-exllamav3.txt /tmp/locks/
RUN pip install --no-cache-dir --require-hashes -r /tmp/locks/worker-exllamav3.txt
# The import is the build (importing the rest of exllamav3 may need a GPU: the library is
# what this step must leave behind). Then the library becomes the precompiled module, the
# build folder goes, and a fresh import must find the module.
RUN export TORCH_EXTENSIONS_DIR=/tmp/exllamav3-build MAX_JOBS=${MAX_JOBS}; \
    python -c "import exllamav3.ext" || echo "import after the build failed (no GPU here)"; \
    so=$(ls "$TORCH_EXTENSIONS_DIR"/exllamav3_ext/exllamav3_ext*.so | head -n 1) \
    && cp "$so" "$(python -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/exllamav3_ext.so" \
    && rm -rf "$TORCH_EXTENSIONS_DIR" \
    && python -c "import torch, exllamav3_ext"

FROM ${CUDA_RUNTIME_IMAGE}
# python3 of the same Ubuntu as the build stage (the venv's interpreter path); gcc, libc
# headers and python3-dev for Triton's run-time launcher builds.
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --create-home sidecar
COPY --from=build /opt/venv /opt/venv
# Triton writes its kernels and launchers under TRITON_CACHE_DIR, and other libraries
# their caches under XDG_CACHE_HOME: /cache, an emptyDir in the pod (overlays/gpu), since
# the root file system is read-only and HOME is not writable there.
ENV PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TRITON_CACHE_DIR=/cache/triton \
    TRITON_HOME=/cache \
    XDG_CACHE_HOME=/cache
WORKDIR /app
COPY pyproject.toml README.md ./
# The worker's own package and the contract only: no proxy code in a worker image.
COPY protocol ./protocol
COPY engine_worker ./engine_worker
RUN pip install --no-cache-dir --no-deps --no-build-isolation .
# The pod's user (deploy/k8s/base: runAsUser 10001, shared with the proxy).
USER 10001
ENTRYPOINT ["python", "-m", "engine_worker", "--backend", "exllamav3"]
