#!/usr/bin/env bash
# The proxy overhead benchmark (benchmarks/proxy_load.py) from a fresh clone:
# installs what it needs, then prints Markdown tables. Options go to proxy_load.py
# (--help). Linux only (it reads /proc). About 10 minutes on 2 cores, plus the
# one-time installs.
#
#   .venv/                     this project, uvloop, py-spy (for --profile)
#   .cache/bench/litellm-venv  LiteLLM's proxy, in a virtual environment of its own
#                              (skip it with --sections levels,saturation,ttft,idle)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LITELLM_VERSION=1.108.7

if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -c "import proxy, uvloop, orjson" 2>/dev/null && [ -x .venv/bin/py-spy ] ||
    .venv/bin/pip install -q -e . uvloop py-spy

if [[ " $* " != *" --sections "* || " $* " == *litellm* ]]; then
    if [ ! -x .cache/bench/litellm-venv/bin/litellm ]; then
        mkdir -p .cache/bench
        "$PY" -m venv .cache/bench/litellm-venv
        .cache/bench/litellm-venv/bin/pip install -q "litellm[proxy]==$LITELLM_VERSION"
    fi
fi

exec .venv/bin/python benchmarks/proxy_load.py "$@"
