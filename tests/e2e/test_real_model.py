"""End to end on the real embedded model (SmolLM2-135M-Instruct on CPU), through
``exl3-sidecar serve``: HTTP, proxy, ZeroMQ, worker, engine."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import httpx_sse
import openai
import orjson
import pytest

from tests.e2e.conftest import Server

pytestmark = pytest.mark.slow

TIMING_KEYS = {"prompt_time", "completion_time", "total_time"}


def long_notes(n_notes: int, tag: str, title: str = "Field notes") -> str:
    colours = ["red", "green", "blue", "amber", "violet", "silver", "black"]
    animals = ["fox", "heron", "otter", "lynx", "badger", "falcon", "moose", "newt"]
    cities = ["Lisbon", "Oslo", "Kyoto", "Quito", "Perth", "Tunis", "Riga", "Lima", "Hanoi"]
    lines = [f"{title} {tag}."]
    for i in range(n_notes):
        lines.append(
            f"Note {i}: the {colours[i % 7]} {animals[i % 8]} was near {cities[i % 9]} on day {i * 3 + 1}."
        )
    lines.append("Which animal was seen most often? Answer in one word.")
    return "\n".join(lines)


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "any",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
    }
    body.update(extra)
    return body


def stream_chunks(
    server: Server, body: dict[str, Any], path: str = "/v1/chat/completions"
) -> list[dict[str, Any]]:
    """Every SSE data event as parsed JSON, up to ``[DONE]`` (which must come)."""
    chunks: list[dict[str, Any]] = []
    with (
        httpx.Client(timeout=120) as client,
        httpx_sse.connect_sse(client, "POST", server.base_url + path, json={**body, "stream": True}) as es,
    ):
        assert es.response.status_code == 200, es.response.read()
        for sse in es.iter_sse():
            if sse.data == "[DONE]":
                return chunks
            chunks.append(orjson.loads(sse.data))
    raise AssertionError("stream ended without [DONE]")


def progress_of(chunks: list[dict[str, Any]]) -> list[dict[str, int]]:
    return [c["prompt_progress"] for c in chunks if "prompt_progress" in c]


def content_of(chunks: list[dict[str, Any]]) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if c["choices"] and "prompt_progress" not in c
    )


def usage_of(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    with_usage = [c for c in chunks if c.get("usage")]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1] and chunks[-1]["choices"] == []
    usage: dict[str, Any] = chunks[-1]["usage"]
    return usage


def test_long_prompt_streams_progress_before_content(server: Server) -> None:
    body = chat_body(
        long_notes(75, uuid.uuid4().hex), return_progress=True, stream_options={"include_usage": True}
    )
    chunks = stream_chunks(server, body)
    usage = usage_of(chunks)
    assert 1300 <= usage["prompt_tokens"] <= 2200  # ~1,500-token prompt
    first_content = next(
        i for i, c in enumerate(chunks) if c["choices"] and (c["choices"][0]["delta"].get("content") or "")
    )
    progress_idx = [i for i, c in enumerate(chunks) if "prompt_progress" in c]
    assert len(progress_idx) >= 3
    assert max(progress_idx) < first_content, "no progress chunk after content starts"
    prog = progress_of(chunks)
    processed = [p["processed"] for p in prog]
    assert processed == sorted(processed)
    assert prog[0]["processed"] == prog[0]["cache"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert prog[-1]["processed"] == prog[-1]["total"] == usage["prompt_tokens"]
    assert all(p["total"] == usage["prompt_tokens"] for p in prog)
    times = [p["time_ms"] for p in prog]
    assert times == sorted(times) and all(isinstance(t, int) for t in times)
    for i in progress_idx:  # llama.cpp's shape: a choices array with an empty assistant delta
        assert chunks[i]["object"] == "chat.completion.chunk"
        assert chunks[i]["choices"] == [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": None},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")

    # Without the flag: the same stream minus the progress chunks, nothing else.
    plain = stream_chunks(server, {k: v for k, v in body.items() if k != "return_progress"})
    assert progress_of(plain) == []
    assert all("prompt_progress" not in c for c in plain)
    assert len(plain) == len(chunks) - len(progress_idx)
    assert content_of(plain) == content_of(chunks)
    assert plain[0]["choices"][0]["delta"]["role"] == "assistant"


def _template_prefix_len() -> int:
    """Tokens the chat template puts before any user content: the longest common
    prefix of two conversations that differ only in the user's text."""
    from tests.fakes.cpu import load_tokenizer_embedded

    tok = load_tokenizer_embedded()
    a = tok.apply_chat_template(
        [{"role": "user", "content": "alpha"}], add_generation_prompt=True, tokenize=True
    )
    b = tok.apply_chat_template(
        [{"role": "user", "content": "omega"}], add_generation_prompt=True, tokenize=True
    )
    a, b = list(getattr(a, "input_ids", a)), list(getattr(b, "input_ids", b))
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_same_long_prompt_twice_hits_prefix_cache(server: Server) -> None:
    # A title no other test's prompt starts with: only the template prefix can be shared.
    body = chat_body(
        long_notes(90, uuid.uuid4().hex, title="Ledger"),
        return_progress=True,
        stream_options={"include_usage": True},
    )
    first = stream_chunks(server, body)
    second = stream_chunks(server, body)
    u1, u2 = usage_of(first), usage_of(second)
    total = u1["prompt_tokens"]
    assert u2["prompt_tokens"] == total
    assert 0 <= u1["prompt_tokens_details"]["cached_tokens"] <= _template_prefix_len()
    cached2 = u2["prompt_tokens_details"]["cached_tokens"]
    # whole 16-token blocks (the CPU engine's prefix-cache block), never the last prompt token
    assert cached2 == (total - 1) // 16 * 16 > 0
    assert progress_of(second)[0]["cache"] == cached2
    assert progress_of(second)[0]["processed"] == cached2
    assert "completion_tokens_details" not in u2  # drafting is off on this server


PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. "
    "He trimmed the wick, polished the great lens, and wrote the weather in his log. "
    "Ships passed safely through the narrow strait because the light never failed."
)


def test_ngram_drafting_accepts_tokens_and_keeps_greedy_output(
    server: Server, drafting_server: Server
) -> None:
    # A salt of its own: no prefix-cache hit from earlier tests on either server. A
    # hit that ends inside a prompt chunk may change the last bits of the rest
    # (docs/performance.md#batch-invariance), and this prompt has a near-tie
    # ("trimmed the wick" / "trimmed the great lens") that such bits decide.
    body = chat_body(
        f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
        max_tokens=60,
        stream_options={"include_usage": True},
        cache_salt=uuid.uuid4().hex,
    )
    drafted = stream_chunks(drafting_server, body)
    plain = stream_chunks(server, body)
    ud, up = usage_of(drafted), usage_of(plain)
    details = ud["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
    assert details["rejected_prediction_tokens"] >= 0
    assert content_of(drafted) == content_of(plain)
    assert len(content_of(plain)) > 40
    assert ud["completion_tokens"] == up["completion_tokens"]
    assert "completion_tokens_details" not in up


def test_openai_sdk_streams_with_usage_and_progress(server: Server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": long_notes(20, uuid.uuid4().hex)}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_progress": True},
    )
    chunks = list(stream)
    assert chunks, "no chunks"
    with_usage = [c for c in chunks if c.usage is not None]
    assert with_usage == [chunks[-1]] and chunks[-1].choices == []
    progress = [(c.model_extra or {}).get("prompt_progress") for c in chunks]
    progress = [p for p in progress if p]
    assert progress and progress[-1]["processed"] == progress[-1]["total"] == chunks[-1].usage.prompt_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].usage.prompt_tokens_details is not None
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens is not None


def test_streamed_and_non_streamed_usage_are_equal(server: Server) -> None:
    body = chat_body("Name three colours of the rainbow. " + uuid.uuid4().hex, max_tokens=16)
    httpx.post(
        server.base_url + "/v1/chat/completions", json=body, timeout=120
    ).raise_for_status()  # warm cache
    streamed = usage_of(stream_chunks(server, {**body, "stream_options": {"include_usage": True}}))
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200
    full = r.json()
    plain = full["usage"]
    assert {k: v for k, v in streamed.items() if k not in TIMING_KEYS} == {
        k: v for k, v in plain.items() if k not in TIMING_KEYS
    }
    assert plain["total_tokens"] == plain["prompt_tokens"] + plain["completion_tokens"]
    assert full["choices"][0]["message"]["role"] == "assistant"


def test_greedy_answer_is_sensible(server: Server) -> None:
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json=chat_body("What is the capital of France?", max_tokens=20),
        timeout=120,
    )
    assert r.status_code == 200
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_the_kernels_chosen_at_start_are_shown_and_logged(server: Server) -> None:
    """The start-up choice (``engine_worker.cpu.kernel_choice``) in ``/props``,
    ``/v1/status`` and the worker's one log line, all naming the same kernels."""
    props = httpx.get(server.base_url + "/props", timeout=10).json()["kernels"]
    status = httpx.get(server.base_url + "/v1/status", timeout=10).json()["worker"]["kernels"]
    assert props == status and set(props) == {"head", "layers", "attention"}
    assert props["head"] in ("int_mm", "vnni", "onednn") and props["layers"] in ("vnni", "torch")
    line = next(ln for ln in server.log_path.read_text().splitlines() if "CPU kernels:" in ln)
    for role, name in props.items():
        assert f"{role}={name} (" in line


@pytest.mark.parametrize(
    ("raw", "param_hint"),
    [
        (b'{"model": "x", "messages": [', None),
        (orjson.dumps({"model": "x"}), "messages"),
        (orjson.dumps({"model": "x", "messages": "hello"}), "messages"),
        (
            orjson.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}),
            "max_tokens",
        ),
        (
            orjson.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"}),
            "max_tokens",
        ),
    ],
)
def test_bad_input_is_a_400_and_the_server_keeps_serving(
    server: Server, raw: bytes, param_hint: str | None
) -> None:
    r = httpx.post(
        server.base_url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    if param_hint:
        assert err["param"] == param_hint
    ok = httpx.post(
        server.base_url + "/v1/chat/completions", json=chat_body("Say OK", max_tokens=2), timeout=60
    )
    assert ok.status_code == 200


def test_prompt_longer_than_context_is_context_length_exceeded(server: Server) -> None:
    r = httpx.post(
        server.base_url + "/v1/chat/completions", json=chat_body("word " * 9000, max_tokens=2), timeout=120
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_readme_curl_example(server: Server) -> None:
    """The README's request, byte-level framing included."""
    body = {
        "model": "any",
        "messages": [{"role": "user", "content": "Say OK"}],
        "max_tokens": 10,
        "stream": True,
        "return_progress": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-accel-buffering"] == "no"
        raw = b"".join(r.iter_bytes())
    assert b"\r" not in raw
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")[:-1]
    assert all(e.startswith(b"data: ") for e in events)
    chunks = [orjson.loads(e[6:]) for e in events[:-1]]
    assert progress_of(chunks)
    assert content_of(chunks)
    assert usage_of(chunks)["completion_tokens"] <= 10


def test_client_disconnect_during_prefill_frees_engine_work(server: Server) -> None:
    # ~4,000 tokens: prefill takes seconds, so the client leaves long before it ends.
    body = chat_body(long_notes(200, uuid.uuid4().hex), return_progress=True, max_tokens=4)
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", server.base_url + "/v1/chat/completions", json={**body, "stream": True}) as r,
    ):
        for line in r.iter_lines():
            if "prompt_progress" in line:
                break  # prompt processing has started; go away mid-prefill
    deadline = time.monotonic() + 10
    active = None
    while time.monotonic() < deadline:
        active = httpx.get(server.base_url + "/ready").json().get("worker_active_requests")
        if active == 0:
            break
        time.sleep(0.2)
    assert active == 0, "the worker still holds the abandoned request"
    # The same conversation again: the full prompt is counted, and only the part
    # prefilled before the abort is reused — had the abandoned request run to
    # completion, all but the last prompt token would be cached.
    chunks = stream_chunks(server, {**body, "stream_options": {"include_usage": True}})
    usage = usage_of(chunks)
    assert usage["prompt_tokens"] == progress_of(chunks)[-1]["total"]
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"] - 1
    assert progress_of(chunks)[0]["cache"] == usage["prompt_tokens_details"]["cached_tokens"]


def test_killed_worker_fails_requests_cleanly_and_comes_back(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from tests.e2e.conftest import start_server, stop_server

    srv = start_server(tmp_path_factory.mktemp("serve-kill"))
    try:
        body = chat_body(long_notes(300, uuid.uuid4().hex), return_progress=True, max_tokens=4)
        got_error = None
        with (
            httpx.Client(timeout=60) as client,
            httpx_sse.connect_sse(
                client, "POST", srv.base_url + "/v1/chat/completions", json={**body, "stream": True}
            ) as es,
        ):
            assert es.response.status_code == 200, es.response.read()
            events = es.iter_sse()
            for sse in events:
                if sse.data != "[DONE]" and "prompt_progress" in orjson.loads(sse.data):
                    os.kill(srv.worker_pid(), signal.SIGKILL)
                    break
            rest = [s.data for s in events]
        assert rest[-1] == "[DONE]"
        errors = [orjson.loads(d)["error"] for d in rest[:-1] if d.startswith('{"error"')]
        got_error = errors[0] if errors else None
        assert got_error is not None and got_error["message"]
        # While the worker is down, new requests are refused cleanly, not hung.
        r = httpx.post(srv.base_url + "/v1/chat/completions", json=chat_body("hi", max_tokens=2), timeout=30)
        assert r.status_code in (200, 503)
        if r.status_code == 503:
            assert r.json()["error"]["message"]
        # serve restarts the worker and the proxy picks it up.
        srv.wait_ready(120)
        ok = httpx.post(
            srv.base_url + "/v1/chat/completions", json=chat_body("Say OK", max_tokens=2), timeout=60
        )
        assert ok.status_code == 200
    finally:
        stop_server(srv)


def test_worker_and_proxy_as_separate_processes_over_tcp(tmp_path: Any) -> None:
    """The two-container pod: ``exl3-sidecar worker`` and ``exl3-sidecar proxy``
    started apart, talking over tcp:// loopback; the proxy process never maps torch."""
    import subprocess
    import sys

    from tests.e2e.conftest import _free_port

    in_addr, out_addr = f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXL3_SIDECAR_")}
    env |= {"EXL3_SIDECAR_INPUT_ADDR": in_addr, "EXL3_SIDECAR_OUTPUT_ADDR": out_addr}
    cli = [sys.executable, "-m", "launcher"]
    with (tmp_path / "worker.log").open("wb") as wlog, (tmp_path / "proxy.log").open("wb") as plog:
        # The proxy first: it must wait, not ready, until a worker appears.
        proxy = subprocess.Popen(
            [*cli, "proxy", "--host", "127.0.0.1", "--port", str(port)], stdout=plog, stderr=plog, env=env
        )
        worker = subprocess.Popen([*cli, "worker"], stdout=wlog, stderr=wlog, env=env)
    srv = Server(proxy, f"http://127.0.0.1:{port}", tmp_path / "proxy.log")
    try:
        srv.wait_ready(120)
        r = httpx.post(
            srv.base_url + "/v1/chat/completions", json=chat_body("Say OK", max_tokens=3), timeout=60
        )
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] <= 3
        proxy_maps = Path(f"/proc/{proxy.pid}/maps").read_text()
        worker_maps = Path(f"/proc/{worker.pid}/maps").read_text()
        assert "libtorch" not in proxy_maps and "libtorch" in worker_maps
    finally:
        for p in (worker, proxy):
            p.send_signal(signal.SIGTERM)
        for p in (worker, proxy):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert worker.returncode == 0 and proxy.returncode == 0


def test_serve_proxy_process_maps_no_torch_while_its_worker_does(server: Server) -> None:
    """The sidecar promise under ``serve``: the process answering HTTP has no
    torch module loaded and no libtorch mapped; only the worker child has them."""
    proxy_maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    worker_maps = Path(f"/proc/{server.worker_pid()}/maps").read_text()
    assert "libtorch" not in proxy_maps and "/torch/" not in proxy_maps
    assert "libtorch" in worker_maps and "/torch/_C" in worker_maps
