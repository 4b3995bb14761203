"""The proxy runs on the base install: importing it loads neither torch nor the worker."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import proxy.app, proxy.engine.client, proxy.ops.routes, proxy.dialects.registry
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "engine_worker", "transformers"))
print(",".join(heavy))
"""


def test_proxy_imports_no_torch_and_no_worker() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
