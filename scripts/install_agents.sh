#!/usr/bin/env bash
# Installs the two coding agents that tests/e2e/test_coding_agents.py drives, at
# pinned versions, from the npm registry into a cache directory (never into the
# repository):
#
#   scripts/install_agents.sh [DIR]     # DIR: $EXL3_SIDECAR_AGENTS_DIR, else ~/.cache/exl3-sidecar/agents
#
# Prints nothing but errors; the binaries end up at
#   DIR/codex-<version>/node_modules/.bin/codex
#   DIR/claude-code-<version>/node_modules/.bin/claude
# Idempotent: a version already installed (its stamp file present) is not
# fetched again. Needs node >= 18 and npm on PATH.
set -euo pipefail

CODEX_VERSION=0.171.0
CLAUDE_CODE_VERSION=2.1.332

dir=${1:-${EXL3_SIDECAR_AGENTS_DIR:-$HOME/.cache/exl3-sidecar/agents}}
mkdir -p "$dir"

install() { # name package version bin
  local prefix="$dir/$1-$3"
  [ -f "$prefix/.installed" ] && [ -x "$prefix/node_modules/.bin/$4" ] && return 0
  rm -rf "$prefix"
  mkdir -p "$prefix"
  # --prefix keeps the install out of any global tree; the agents' own
  # auto-updaters are switched off by the test's environment, not here.
  npm install --prefix "$prefix" --no-audit --no-fund --no-save --loglevel=error "$2@$3" >/dev/null
  "$prefix/node_modules/.bin/$4" --version >/dev/null
  touch "$prefix/.installed"
}

install codex @openai/codex "$CODEX_VERSION" codex
install claude-code @anthropic-ai/claude-code "$CLAUDE_CODE_VERSION" claude
