"""The pi extension's status matching (``integrations/pi/status.js``), run by
node's built-in test runner so that the README's one test command runs it too;
skipped only where node is missing (or older than the runner it needs)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

PI = Path(__file__).resolve().parents[2] / "integrations" / "pi"
MIN_NODE = (20, 6)  # what pi 0.73.1 requires (its package.json "engines")


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    m = re.match(r"v(\d+)\.(\d+)", out.strip())
    if m is None or (int(m[1]), int(m[2])) < MIN_NODE:
        pytest.skip(f"node {out.strip()} is older than {MIN_NODE}")
    return node


def test_status_matching_under_nodes_test_runner() -> None:
    node = _node()
    run = subprocess.run(
        [node, "--test", "test/status.test.mjs"],
        cwd=PI,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    counts = dict(re.findall(r"^# (pass|fail) (\d+)$", run.stdout, re.M))
    assert int(counts["fail"]) == 0 and int(counts["pass"]) >= 7, run.stdout
