#!/usr/bin/env bash
# The device check's entry point (docs/exllamav3.md, "Checking on a GPU"):
#   bash scripts/gpu_check.sh build [--budget S]   command 1: the CUDA extension
#   bash scripts/gpu_check.sh run [--budget S]     command 2: engine, backend, proxy
# Command 1 compiles the extension in build/torch_extensions (torch's JIT build, resumable:
# ninja keeps finished objects) and installs the library into build/gpu-check/site as the
# module exllamav3_ext, which command 2's imports load without compiling, as the worker
# image's do. Both folders are git-ignored and kept on a warm machine. The carried wheels
# are installed there once and again only when the list changes: new copies of exllamav3's
# sources would make ninja rebuild everything, and a new site folder drops the module.
set -uo pipefail
cd "$(dirname "$0")/.."

site=build/gpu-check/site
shopt -s nullglob
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "gpu_check: no wheels in .whl/: run 'python scripts/gpu_check_assets.py' first and carry .whl" >&2
    exit 2
fi
stamp=$(printf '%s\n' "${wheels[@]}" | sha256sum | cut -c1-16)
if [ "$(cat "$site/.stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$site"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "${wheels[@]}" \
        || { echo "gpu_check: installing the carried wheels failed" >&2; exit 2; }
    echo "$stamp" >"$site/.stamp"
fi

export PYTHONPATH="$PWD/$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# command 1 installs the built extension here as a module, as the worker image does
export GPU_CHECK_SITE="$PWD/$site"
export PYTHONUNBUFFERED=1
# torch's extension build runs `ninja` and `nvcc` by name
if ninja_bin=$(python3 -c 'import ninja; print(ninja.BIN_DIR)' 2>/dev/null); then PATH="$ninja_bin:$PATH"; fi
if [ -d /usr/local/cuda/bin ]; then PATH="$PATH:/usr/local/cuda/bin"; fi
export PATH
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-16}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/build/triton-cache}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec python3 scripts/gpu_check.py "$@"
