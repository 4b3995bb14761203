"""KV-cache events on TCP as llm-d's pod discovery takes them (issue 41): the README's
``exl3-sidecar serve`` with ``--kv-events-endpoint tcp://127.0.0.1:<port>``, and a
subscriber in another process (``tests.fakes.kv_listen``) that dials that address, as
the scorer dials ``tcp://<pod IP>:<socketPort>``. Prompts that overflow a small prefix
cache show blocks stored and evicted; the second of two equal requests reports the
cached tokens the events announced."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.test_serve import _free_port, _ready, _serve, _wait_for

pytestmark = pytest.mark.slow

BLOCK = 16  # the CPU engine's prefix-cache block at the default --chunk-size
PREFIX_CACHE_MB = 4  # 91 positions of float32 KV (46,080 bytes each): the third prompt evicts


def _prompt(i: int) -> str:
    words = ["river", "stone", "lamp", "cloud", "orchard", "signal", "harbor", "violet"]
    return " ".join(f"{words[(i + k) % len(words)]}{k}" for k in range(24))


def test_a_subscriber_dialling_the_endpoint_sees_blocks_stored_and_evicted(tmp_path: Path) -> None:
    events_port = _free_port()
    endpoint = f"tcp://127.0.0.1:{events_port}"
    log = tmp_path / "serve.log"
    proc, port = _serve(
        log, "--", "--kv-events-endpoint", endpoint, "--prefix-cache-mb", str(PREFIX_CACHE_MB)
    )
    listener = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.kv_listen", endpoint],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    lines: queue.Queue[str] = queue.Queue()
    out = listener.stdout
    assert out is not None
    reader = threading.Thread(target=lambda: [lines.put(x) for x in out], daemon=True)
    reader.start()
    try:
        _wait_for(lambda: _ready(port), 300, "/ready", log)
        assert f"KV-cache events listening on {endpoint}" in log.read_text()
        assert lines.get(timeout=30).strip() == "connected"
        time.sleep(0.5)  # the subscription reaches the PUB after the connection
        url = f"http://127.0.0.1:{port}/v1/completions"
        cached = []
        for i in (0, 0, 1, 2, 3):
            r = httpx.post(url, json={"prompt": _prompt(i), "max_tokens": 1, "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            cached.append(usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
        messages = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                messages.append(json.loads(lines.get(timeout=1)))
            except queue.Empty:
                if any(m["removed"] for m in messages):
                    break
        stored = [block for m in messages for block in m["stored"]]
        assert stored and all(len(b) == BLOCK for b in stored)
        assert {m["topic"].split("@")[0] for m in messages} == {"kv"}
        seqs = [m["seq"] for m in messages]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        # The first prompt's whole blocks, as the tokenizer gave them to the engine.
        ids = httpx.post(f"http://127.0.0.1:{port}/tokenize", json={"prompt": _prompt(0)}, timeout=30).json()[
            "tokens"
        ]
        whole = len(ids) // BLOCK * BLOCK
        assert stored[: whole // BLOCK] == [ids[k : k + BLOCK] for k in range(0, whole, BLOCK)]
        assert cached[0] == 0 and cached[1] > 0 and cached[1] % BLOCK == 0
        assert sum(m["removed"] for m in messages) > 0, messages  # four prompts overflow 91 positions
    finally:
        if listener.stdin is not None:
            listener.stdin.close()
        listener.wait(10)
        reader.join(10)
        out.close()
        proc.terminate()
        proc.wait(30)
