#!/usr/bin/env bash
# The device check's one command (docs/exllamav3.md, "Checking on a GPU"):
#   bash scripts/gpu_check.sh all [--budget S] [--only PHASES]     on the GPU machine
#   bash scripts/gpu_check.sh all --dry-run [...]                  anywhere: stand-ins for nvcc and CUDA
# It installs the wheels carried in .whl/ into build/gpu-check/site once (again only when
# the list changes: new copies of exllamav3's sources would make ninja rebuild everything),
# sets the environment every phase shares and runs scripts/gpu_check.py, which builds the
# extension (or restores one carried in .whl/gpu-check-ext/), warms Triton and runs the
# scenarios, writing its summary, log and the built library's pieces into $OUT as it goes.
set -uo pipefail
cd "$(dirname "$0")/.."

dry_run=0
args=()
for a in "$@"; do
    if [ "$a" = --dry-run ]; then dry_run=1; else args+=("$a"); fi
done

site="${GPU_CHECK_SITE:-$PWD/build/gpu-check/site}"
if [ "$dry_run" = 0 ]; then
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
fi

export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$dry_run" = 1 ]; then
    # tests/fakes/gpu_standin: an nvcc, CUDA in torch and an exllamav3 over the fake engine,
    # each failing where the real one would (no arch list, no Triton cache dir, no module).
    standin="$PWD/tests/fakes/gpu_standin"
    export PATH="$standin/bin:$PATH" PYTHONPATH="$standin:$PYTHONPATH" GPU_CHECK_STANDIN=1
fi
# the build installs the extension here as a module, as the worker image does
export GPU_CHECK_SITE="$site"
export PYTHONUNBUFFERED=1
# torch's extension build runs `ninja` and `nvcc` by name
if ninja_bin=$(python3 -c 'import ninja; print(ninja.BIN_DIR)' 2>/dev/null); then PATH="$ninja_bin:$PATH"; fi
if [ -d /usr/local/cuda/bin ]; then PATH="$PATH:/usr/local/cuda/bin"; fi
export PATH
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR-$PWD/build/triton-cache}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec python3 scripts/gpu_check.py "${args[@]}"
