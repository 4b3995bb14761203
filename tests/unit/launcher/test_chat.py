"""``exl3-sidecar chat`` against a scripted server, in plain mode, in each API (``--api``).

The server (aiohttp, in the test's loop) plays a list of steps: chunks, named
events, raw ``data:`` payloads and pauses. One story (a queue, a prefill, an
answer, a usage) is scripted in each API's own events (``script``), and the
command must show the same lines for all three. The command runs in a thread
(click's ``CliRunner``, which keeps stdout and stderr apart) or as a subprocess
with real pipes. Expected lines are computed here from the script's numbers.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from click.testing import CliRunner, Result

from launcher.chat.apis import ANTHROPIC_VERSION, MESSAGES_DEFAULT_MAX_TOKENS
from launcher.cli import main
from tests.fakes.chat_server import MODEL, PATHS, ScriptedServer, Step

TOTAL, CACHE = 1024, 256
QUEUE = [  # position, queued, time_ms, eta_ms
    (3, 3, 0, None),
    (2, 2, 400, None),
    (1, 1, 800, 1500),
]
PREFILL = [(256, 0), (512, 300), (768, 600), (1024, 900)]  # processed, time_ms
PIECES = ["Hello", ",", " wor", "ld", "!"]
FIRST_TOKEN_PAUSE_S = 0.2
TOKEN_PAUSE_S = 0.05
USAGE: dict[str, Any] = {
    "prompt_tokens": TOTAL,
    "completion_tokens": 64,
    "total_tokens": TOTAL + 64,
    "prompt_tokens_details": {"cached_tokens": CACHE},
    "completion_tokens_details": {"accepted_prediction_tokens": 40, "rejected_prediction_tokens": 10},
    "prompt_time": 0.9,
}

APIS = ["chat", "responses", "messages"]


def chunk(**extra: Any) -> dict[str, Any]:
    """A progress chunk (llama.cpp's shape) with ``extra`` keys, e.g. ``prompt_progress``."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": None},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        **extra,
    }


def content(text: str) -> dict[str, Any]:
    c = chunk()
    c["choices"][0]["delta"] = {"content": text}
    return c


def finish(reason: str = "stop") -> dict[str, Any]:
    c = chunk()
    c["choices"][0].update(delta={}, finish_reason=reason)
    return c


def usage(u: dict[str, Any]) -> dict[str, Any]:
    return {**chunk(), "choices": [], "usage": u}


def answer_steps(pieces: list[str]) -> list[Step]:
    steps: list[Step] = [FIRST_TOKEN_PAUSE_S]
    for i, p in enumerate(pieces):
        if i:
            steps.append(TOKEN_PAUSE_S)
        steps.append(content(p))
    return steps


def full_script() -> list[Step]:
    steps: list[Step] = []
    for position, queued, time_ms, eta_ms in QUEUE:
        q: dict[str, Any] = {"position": position, "queued": queued, "time_ms": time_ms}
        if eta_ms is not None:
            q["eta_ms"] = eta_ms
        steps.append(chunk(queue_progress=q))
    for processed, time_ms in PREFILL:
        p = {"total": TOTAL, "cache": CACHE, "processed": processed, "time_ms": time_ms}
        steps.append(chunk(prompt_progress=p))
    return [*steps, *answer_steps(PIECES), finish(), usage(USAGE), "[DONE]"]


def queue_dicts() -> list[dict[str, Any]]:
    out = []
    for position, queued, time_ms, eta_ms in QUEUE:
        q: dict[str, Any] = {"position": position, "queued": queued, "time_ms": time_ms}
        if eta_ms is not None:
            q["eta_ms"] = eta_ms
        out.append(q)
    return out


def prefill_dicts() -> list[dict[str, Any]]:
    return [{"total": TOTAL, "cache": CACHE, "processed": p, "time_ms": t} for p, t in PREFILL]


def answer_pauses(events: list[Step]) -> list[Step]:
    """``events`` (one per piece of text) with the first-token and inter-token pauses."""
    steps: list[Step] = [FIRST_TOKEN_PAUSE_S]
    for i, e in enumerate(events):
        if i:
            steps.append(TOKEN_PAUSE_S)
        steps.append(e)
    return steps


def responses_usage(u: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage ``u`` in the Responses API's words."""
    details = u.get("completion_tokens_details") or {}
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0, **details},
        "total_tokens": u["total_tokens"],
    }


def responses_script(pieces: list[str], reason: str = "stop", progress: bool = True) -> list[Step]:
    def ev(kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        return (kind, {"type": kind, "sequence_number": 0, **data})

    response = {"id": "resp_1", "object": "response", "status": "in_progress", "output": [], "usage": None}
    steps: list[Step] = [
        ev("response.created", response=response),
        ev("response.in_progress", response=response),
    ]
    if progress:
        steps += [ev("response.queue_progress", queue_progress=q) for q in queue_dicts()]
        steps += [ev("response.prompt_progress", prompt_progress=p) for p in prefill_dicts()]
    item = {"id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant", "content": []}
    steps += [
        ev("response.output_item.added", output_index=0, item=item),
        ev("response.content_part.added", item_id="msg_1", output_index=0, content_index=0, part={}),
    ]
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    steps += answer_pauses([ev("response.output_text.delta", **where, delta=p, logprobs=[]) for p in pieces])
    text = "".join(pieces)
    steps += [
        ev("response.output_text.done", **where, text=text, logprobs=[]),
        ev("response.output_item.done", output_index=0, item={**item, "status": "completed"}),
    ]
    final = {**response, "status": "completed", "usage": responses_usage(USAGE)}
    if reason == "length":
        final.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        steps.append(ev("response.incomplete", response=final))
    else:
        steps.append(ev("response.completed", response=final))
    return steps


def messages_script(pieces: list[str], reason: str = "end_turn", progress: bool = True) -> list[Step]:
    """As Anthropic's API sends it: the prompt's usage in ``message_start``, only the
    output's in ``message_delta`` (here with this project's draft counters)."""

    def ev(kind: str, **data: Any) -> tuple[str, dict[str, Any]]:
        return (kind, {"type": kind, **data})

    cached = USAGE["prompt_tokens_details"]["cached_tokens"]
    start_usage = {
        "input_tokens": USAGE["prompt_tokens"] - cached,
        "output_tokens": 1,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }
    message = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "usage": start_usage}
    steps: list[Step] = [ev("message_start", message=message)]
    if progress:
        steps += [ev("queue_progress", queue_progress=q) for q in queue_dicts()]
        steps += [ev("prompt_progress", prompt_progress=p) for p in prefill_dicts()]
    steps += [ev("content_block_start", index=0, content_block={"type": "text", "text": ""}), ev("ping")]
    steps += answer_pauses(
        [ev("content_block_delta", index=0, delta={"type": "text_delta", "text": p}) for p in pieces]
    )
    details = USAGE["completion_tokens_details"]
    delta_usage = {"output_tokens": USAGE["completion_tokens"], **details}
    steps += [
        ev("content_block_stop", index=0),
        ev("message_delta", delta={"stop_reason": reason, "stop_sequence": None}, usage=delta_usage),
        ev("message_stop"),
    ]
    return steps


def through_text(steps: list[Step]) -> list[Step]:
    """``steps`` up to the last event of answer text: no closing events."""
    text_events = ("response.output_text.delta", "content_block_delta")
    last = max(i for i, step in enumerate(steps) if isinstance(step, tuple) and step[0] in text_events)
    return steps[: last + 1]


def script(api: str) -> list[Step]:
    """The whole story (queue, prefill, answer, usage) in ``api``'s events."""
    if api == "responses":
        return responses_script(PIECES)
    if api == "messages":
        return messages_script(PIECES)
    return full_script()


async def serve(aiohttp_server: Any, script: list[Step], **kw: Any) -> ScriptedServer:
    s = ScriptedServer(script, **kw)
    server: TestServer = await aiohttp_server(s.app())
    s.base_url = str(server.make_url("/v1"))
    return s


async def run_cli(
    args: list[str], input: str | None = None, env: dict[str, str | None] | None = None
) -> Result:
    """``exl3-sidecar ARGS`` in a thread, so the server keeps running in this loop."""
    return await asyncio.to_thread(CliRunner().invoke, main, args, input=input, env=env)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No key or proxy from the machine running the tests reaches the client."""
    for name in ("EXL3_SIDECAR_API_KEY", "OPENAI_API_KEY", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    yield


def usage_numbers(line: str) -> dict[str, float]:
    """The numbers of a usage line, by name."""
    out: dict[str, float] = {}
    m = re.search(r"prompt (\d+) \(cached (\d+), (\d+)%\)", line)
    if m:
        out.update(prompt=int(m[1]), cached=int(m[2]), cached_pct=int(m[3]))
    if m := re.search(r"completion (\d+)", line):
        out["completion"] = int(m[1])
    if m := re.search(r"drafts accepted (\d+)/(\d+) \((\d+)%\)", line):
        out.update(accepted=int(m[1]), verified=int(m[2]), accepted_pct=int(m[3]))
    if m := re.search(r"ttft ([\d.]+) s", line):
        out["ttft"] = float(m[1])
    if m := re.search(r"decode ([\d.]+) tok/s", line):
        out["decode"] = float(m[1])
    return out


@pytest.mark.parametrize("api", APIS)
async def test_plain_run_shows_queue_prefill_answer_and_usage(aiohttp_server: Any, api: str) -> None:
    server = await serve(aiohttp_server, script(api))
    r = await run_cli(["chat", "--base-url", server.base_url, "--api", api, "Say hello"])
    assert r.exit_code == 0, r.output
    assert r.stdout == "".join(PIECES) + "\n"
    assert "\x1b" not in r.output
    lines = r.stderr.splitlines()

    queued = [line for line in lines if line.startswith("queued:")]
    expected_queue = []
    for position, n, time_ms, eta_ms in QUEUE:
        line = f"queued: position {position} of {n}, waited {time_ms / 1000:.1f} s"
        expected_queue.append(line + (f", eta {eta_ms / 1000:.1f} s" if eta_ms is not None else ""))
    assert queued == expected_queue

    prefill = [line for line in lines if line.startswith("prefill:")]
    assert prefill[0] == f"prefill: {CACHE}/{TOTAL} tokens (cached {CACHE})"
    last_ms = PREFILL[-1][1]
    rate = (TOTAL - CACHE) / (last_ms / 1000)
    assert prefill[-1] == f"prefill: {TOTAL}/{TOTAL} tokens (cached {CACHE}), {rate:.0f} tok/s, in 0.90 s"
    assert len(prefill) <= len(PREFILL)

    (usage_line,) = [line for line in lines if line.startswith("usage:")]
    got = usage_numbers(usage_line)
    details = USAGE["completion_tokens_details"]
    accepted, rejected = details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]
    assert got["prompt"] == USAGE["prompt_tokens"] and got["cached"] == CACHE
    assert got["cached_pct"] == round(100 * CACHE / TOTAL)
    assert got["completion"] == USAGE["completion_tokens"]
    assert (got["accepted"], got["verified"]) == (accepted, accepted + rejected)
    assert got["accepted_pct"] == round(100 * accepted / (accepted + rejected))
    # The server's pauses bound the times: ttft from below; decode from above, loosely, since a
    # late first chunk shortens the measured span (the exact formula: test_chat_stats).
    assert got["ttft"] >= FIRST_TOKEN_PAUSE_S
    gaps_s = TOKEN_PAUSE_S * (len(PIECES) - 1)
    assert 0 < got["decode"] <= 2 * (USAGE["completion_tokens"] - 1) / gaps_s

    # The order a reader of both streams sees.
    out = r.output
    assert out.index("queued:") < out.index("prefill:") < out.index(PIECES[0]) < out.index("usage:")

    assert server.paths == [PATHS[api]]
    (body,) = server.bodies
    assert body["model"] == MODEL
    assert body["stream"] is True and body["return_progress"] is True
    assert "temperature" not in body
    if api == "chat":
        assert body["messages"] == [{"role": "user", "content": "Say hello"}]
        assert body["stream_options"] == {"include_usage": True}
        assert "max_tokens" not in body
    elif api == "responses":
        assert body["input"] == "Say hello" and body["store"] is False
        assert "max_output_tokens" not in body and "instructions" not in body
    else:
        assert body["messages"] == [{"role": "user", "content": "Say hello"}]
        assert body["max_tokens"] == MESSAGES_DEFAULT_MAX_TOKENS  # required by the API
        assert "system" not in body
        assert server.headers[0]["anthropic-version"] == ANTHROPIC_VERSION
        assert "x-api-key" not in server.headers[0]
    assert server.auth == [None]


async def test_options_reach_the_request(aiohttp_server: Any) -> None:
    server = await serve(aiohttp_server, full_script())
    r = await run_cli(
        [
            "chat",
            "--base-url",
            server.base_url + "/",
            "--system",
            "Be brief.",
            "--model",
            "mine",
            "--max-tokens",
            "7",
            "--temperature",
            "0.5",
            "--api-key",
            "sk-test",
            "hi",
        ]
    )
    assert r.exit_code == 0, r.output
    (body,) = server.bodies
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (body["model"], body["max_tokens"], body["temperature"]) == ("mine", 7, 0.5)
    assert server.auth == ["Bearer sk-test"]
    assert server.models_calls == 0


@pytest.mark.parametrize(
    ("env", "header"),
    [
        ({"EXL3_SIDECAR_API_KEY": " k1 ,k2", "OPENAI_API_KEY": "o"}, "Bearer k1"),
        ({"OPENAI_API_KEY": "o"}, "Bearer o"),
        ({}, None),
    ],
)
async def test_api_key_from_the_environment(
    aiohttp_server: Any, env: dict[str, str | None], header: str | None
) -> None:
    server = await serve(aiohttp_server, full_script())
    r = await run_cli(["chat", "--base-url", server.base_url, "hi"], env=env)
    assert r.exit_code == 0, r.output
    assert server.auth == [header]


@pytest.mark.parametrize("listing", ["missing", "empty"])
async def test_model_falls_back_to_default(aiohttp_server: Any, listing: str) -> None:
    server = await serve(aiohttp_server, full_script(), models=[])
    server.models_route = listing != "missing"
    r = await run_cli(["chat", "--base-url", server.base_url, "hi"])
    assert r.exit_code == 0, r.output
    assert server.bodies[0]["model"] == "default"


async def test_a_server_without_extensions(aiohttp_server: Any) -> None:
    # What api.openai.com sends: no progress, draft counters at 0, cached_tokens present.
    plain_usage = {
        "prompt_tokens": 12,
        "completion_tokens": 3,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }
    script: list[Step] = [*answer_steps(["a", "b", "c"]), finish(), usage(plain_usage), "[DONE]"]
    server = await serve(aiohttp_server, script)
    r = await run_cli(["chat", "--base-url", server.base_url, "hi"])
    assert r.exit_code == 0, r.output
    assert r.stdout == "abc\n"
    (line,) = r.stderr.splitlines()
    assert line.startswith("usage: prompt 12 (cached 0, 0%), completion 3, ttft ")
    assert "drafts" not in line and "decode" in line


async def test_no_usage_and_no_done_is_still_an_answer(aiohttp_server: Any) -> None:
    # Older llama.cpp servers close the stream after the finish chunk without [DONE].
    server = await serve(aiohttp_server, [*answer_steps(["ok\n"]), finish("length")])
    r = await run_cli(["chat", "--base-url", server.base_url, "hi"])
    assert r.exit_code == 0, r.output
    assert r.stdout == "ok\n"
    (line,) = r.stderr.splitlines()
    assert re.fullmatch(r"usage: not reported by the server, ttft [\d.]+ s, finish length", line)


async def test_a_stream_cut_before_the_end_is_an_error(aiohttp_server: Any) -> None:
    server = await serve(aiohttp_server, answer_steps(["half"]))
    r = await run_cli(["chat", "--base-url", server.base_url, "hi"])
    assert r.exit_code == 1
    assert r.stdout == "half\n"
    assert r.stderr == "error: the server closed the stream before the answer finished\n"


async def test_an_error_envelope_is_shown_and_exits_1(aiohttp_server: Any) -> None:
    server = await serve(aiohttp_server, [])
    message = "The prompt (9000 tokens) is longer than the context (8192 tokens)"
    envelope = {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    server.reply = (400, json.dumps(envelope))
    r = await run_cli(["chat", "--base-url", server.base_url, "hi"])
    assert r.exit_code == 1
    assert r.stdout == ""
    assert r.stderr == f"error: {message} (HTTP 400, context_length_exceeded)\n"


async def test_an_error_body_that_is_not_an_envelope(aiohttp_server: Any) -> None:
    server = await serve(aiohttp_server, [])
    server.reply = (502, "<html>  Bad\n gateway </html>")
    r = await run_cli(["chat", "--base-url", server.base_url, "hi"])
    assert r.exit_code == 1
    assert r.stderr == "error: <html> Bad gateway </html> (HTTP 502)\n"


async def test_an_error_event_mid_stream(aiohttp_server: Any) -> None:
    error = {
        "error": {"message": "engine died", "type": "server_error", "param": None, "code": "engine_dead"}
    }
    server = await serve(aiohttp_server, [*answer_steps(["partial"]), error, "[DONE]"])
    r = await run_cli(["chat", "--base-url", server.base_url, "hi"])
    assert r.exit_code == 1
    assert r.stdout == "partial\n"
    assert r.stderr == "error: engine died (engine_dead)\n"


async def test_a_reply_that_is_not_a_stream(aiohttp_server: Any) -> None:
    server = await serve(aiohttp_server, [])
    server.reply = (200, json.dumps({"object": "chat.completion", "choices": []}))
    r = await run_cli(["chat", "--base-url", server.base_url, "hi"])
    assert r.exit_code == 1
    assert r.stderr.startswith("error: the server did not answer with a stream: ")


async def test_a_silent_server_times_out(aiohttp_server: Any) -> None:
    server = await serve(aiohttp_server, [30.0])
    r = await run_cli(["chat", "--base-url", server.base_url, "--timeout", "0.3", "hi"])
    assert r.exit_code == 1
    assert r.stderr == f"error: {server.base_url} sent nothing for too long (ReadTimeout); see --timeout\n"
    await asyncio.wait_for(server.disconnected.wait(), 10)


async def test_connection_refused_is_one_line_and_exit_1() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Closed without listen: nothing accepts on that port now.
    r = await run_cli(["chat", "--base-url", f"http://127.0.0.1:{port}/v1", "--wait", "0", "hi"])
    assert r.exit_code == 1
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"error: cannot connect to http://127.0.0.1:{port}/v1: ")
    assert "Traceback" not in r.output
    # By default a server not listening yet (serve just started) gets a few seconds first.
    r = await run_cli(["chat", "--base-url", f"http://127.0.0.1:{port}/v1", "--wait", "0.5", "hi"])
    assert r.exit_code == 1
    waiting, error = r.stderr.splitlines()
    assert waiting == "waiting for the server to listen" and error.startswith("error: cannot connect")


@pytest.mark.parametrize("source", ["file", "stdin", "dash"])
async def test_prompt_from_a_file_or_stdin(aiohttp_server: Any, tmp_path: Path, source: str) -> None:
    server = await serve(aiohttp_server, full_script())
    text = "Summarize:\nline one — ünïcode\nline two"
    args = ["chat", "--base-url", server.base_url]
    stdin = None
    if source == "file":
        path = tmp_path / "prompt.txt"
        path.write_text(text + "\n", encoding="utf-8")
        args += ["--file", str(path)]
    else:
        stdin = text + "\n"
        args += ["-"] if source == "dash" else []
    r = await run_cli(args, input=stdin)
    assert r.exit_code == 0, r.output
    assert server.bodies[0]["messages"] == [{"role": "user", "content": text}]


@pytest.mark.parametrize(
    ("args", "stdin", "says"),
    [
        (["hi", "--file", __file__], None, "not both"),
        ([], "  \n", "the prompt is empty"),
        (["--max-tokens", "0", "hi"], None, "--max-tokens"),
    ],
)
def test_usage_errors_exit_2(args: list[str], stdin: str | None, says: str) -> None:
    r = CliRunner().invoke(main, ["chat", "--base-url", "http://127.0.0.1:9/v1", *args], input=stdin)
    assert r.exit_code == 2 and says in r.stderr


def test_help_names_the_streams_and_exit_statuses() -> None:
    r = CliRunner().invoke(main, ["chat", "--help"])
    assert r.exit_code == 0
    assert "stdout" in r.output and "stderr" in r.output and "130" in r.output


CHAT_COMMAND = [sys.executable, "-m", "launcher", "chat"]


async def test_real_pipes_keep_the_answer_alone_on_stdout(aiohttp_server: Any) -> None:
    server = await serve(aiohttp_server, full_script())
    proc = await asyncio.create_subprocess_exec(
        *CHAT_COMMAND,
        "--base-url",
        server.base_url,
        "hi",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=os.environ | {"TERM": "xterm-256color", "FORCE_COLOR": "1"},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err
    assert out.decode() == "".join(PIECES) + "\n"
    assert b"\x1b" not in err and b"usage: prompt" in err


async def test_ctrl_c_closes_the_stream_and_exits_130(aiohttp_server: Any) -> None:
    # The server sends one queue chunk, then stays silent as a long wait would.
    server = await serve(
        aiohttp_server, [chunk(queue_progress={"position": 1, "queued": 1, "time_ms": 0}), 60.0]
    )
    proc = await asyncio.create_subprocess_exec(
        *CHAT_COMMAND,
        "--base-url",
        server.base_url,
        "hi",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    first = await asyncio.wait_for(proc.stderr.readline(), 60)
    assert first.startswith(b"queued: position 1 of 1")
    proc.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 130
    assert err.decode() == "error: interrupted\n"
    await asyncio.wait_for(server.disconnected.wait(), 10)


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_options_reach_the_request_in_each_api(aiohttp_server: Any, api: str) -> None:
    server = await serve(aiohttp_server, script(api))
    args = ["--system", "Be brief.", "--model", "mine", "--max-tokens", "7", "--temperature", "0.5"]
    r = await run_cli(["chat", "--base-url", server.base_url, "--api", api, *args, "--api-key", "sk-t", "hi"])
    assert r.exit_code == 0, r.output
    (body,) = server.bodies
    (headers,) = server.headers
    assert (body["model"], body["temperature"]) == ("mine", 0.5)
    if api == "responses":
        assert (body["instructions"], body["input"], body["max_output_tokens"]) == ("Be brief.", "hi", 7)
        assert server.auth == ["Bearer sk-t"]
    else:
        assert (body["system"], body["max_tokens"]) == ("Be brief.", 7)
        assert body["messages"] == [{"role": "user", "content": "hi"}]
        assert headers["x-api-key"] == "sk-t" and server.auth == [None]
    assert server.models_calls == 0


@pytest.mark.parametrize(
    ("env", "header"),
    [
        ({"EXL3_SIDECAR_API_KEY": "k1,k2", "ANTHROPIC_API_KEY": "a"}, "k1"),
        ({"ANTHROPIC_API_KEY": "a", "OPENAI_API_KEY": "o"}, "a"),
        ({"OPENAI_API_KEY": "o"}, None),
    ],
)
async def test_messages_key_from_the_environment(
    aiohttp_server: Any, env: dict[str, str | None], header: str | None
) -> None:
    server = await serve(aiohttp_server, script("messages"))
    r = await run_cli(["chat", "--base-url", server.base_url, "--api", "messages", "hi"], env=env)
    assert r.exit_code == 0, r.output
    assert server.headers[0].get("x-api-key") == header and server.auth == [None]


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_a_cut_answer_says_finish_length_in_each_api(aiohttp_server: Any, api: str) -> None:
    steps = (
        responses_script(["ok"], reason="length", progress=False)
        if api == "responses"
        else messages_script(["ok"], reason="max_tokens", progress=False)
    )
    server = await serve(aiohttp_server, steps)
    r = await run_cli(["chat", "--base-url", server.base_url, "--api", api, "hi"])
    assert r.exit_code == 0, r.output
    assert r.stdout == "ok\n"
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"usage: prompt {TOTAL} (cached {CACHE}, ") and line.endswith(", finish length")


@pytest.mark.parametrize("api", ["responses", "messages"])
async def test_a_stream_cut_before_its_end_event_is_an_error_in_each_api(
    aiohttp_server: Any, api: str
) -> None:
    whole = responses_script(["half"]) if api == "responses" else messages_script(["half"])
    cut = through_text(whole)
    server = await serve(aiohttp_server, cut)
    r = await run_cli(["chat", "--base-url", server.base_url, "--api", api, "hi"])
    assert r.exit_code == 1
    assert r.stdout == "half\n"
    assert r.stderr.splitlines()[-1] == "error: the server closed the stream before the answer finished"


async def test_an_anthropic_error_body_is_shown_with_its_type(aiohttp_server: Any) -> None:
    server = await serve(aiohttp_server, [])
    body = {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    server.reply = (400, json.dumps(body))
    r = await run_cli(["chat", "--base-url", server.base_url, "--api", "messages", "hi"])
    assert r.exit_code == 1
    assert r.stderr == "error: max_tokens: Field required (HTTP 400, invalid_request_error)\n"


@pytest.mark.parametrize(
    ("api", "event", "line"),
    [
        (
            "responses",
            (
                "response.failed",
                {
                    "type": "response.failed",
                    "response": {
                        "status": "failed",
                        "error": {"code": "server_error", "message": "engine died"},
                    },
                },
            ),
            "error: engine died (server_error)",
        ),
        (
            "responses",
            (
                "error",
                {"type": "error", "code": "rate_limit_exceeded", "message": "slow down", "param": None},
            ),
            "error: slow down (rate_limit_exceeded)",
        ),
        (
            "messages",
            ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
            "error: Overloaded (overloaded_error)",
        ),
    ],
)
async def test_an_error_event_mid_stream_in_each_api(
    aiohttp_server: Any, api: str, event: tuple[str, dict[str, Any]], line: str
) -> None:
    whole = responses_script(["partial"]) if api == "responses" else messages_script(["partial"])
    cut = through_text(whole)
    server = await serve(aiohttp_server, [*cut, event])
    r = await run_cli(["chat", "--base-url", server.base_url, "--api", api, "hi"])
    assert r.exit_code == 1
    assert r.stdout == "partial\n"
    assert r.stderr.splitlines()[-1] == line


async def test_port_is_short_for_a_local_base_url(aiohttp_server: Any) -> None:
    server = await serve(aiohttp_server, full_script())
    port = str(server.base_url.split(":")[-1].split("/")[0])
    assert server.base_url == f"http://127.0.0.1:{port}/v1"  # what --port stands for
    r = await run_cli(["chat", "--port", port, "hi"])
    assert r.exit_code == 0, r.output
    assert r.stdout == "".join(PIECES) + "\n" and server.paths == [PATHS["chat"]]


def test_port_and_base_url_together_is_a_usage_error() -> None:
    r = CliRunner().invoke(main, ["chat", "--port", "5000", "--base-url", "http://127.0.0.1:9/v1", "hi"])
    assert r.exit_code == 2 and "not both" in r.stderr


def test_an_interrupt_python_swallows_still_ends_the_command_with_130() -> None:
    """A Ctrl-C that lands where Python only prints it (a ``__del__``, here a loop that
    catches it) still ends the process after the grace period, with 130 and the line."""
    child = (
        "import sys, time\n"
        "from launcher.chat import command\n"
        "command.INTERRUPT_GRACE_S = 0.2\n"
        "armed = False\n"
        "with command._interrupt_for_sure():\n"
        "    while True:\n"
        "        try:\n"  # 'armed' inside the try: the signal never lands outside it
        "            if not armed:\n"
        "                armed = True\n"
        "                print('armed', flush=True)\n"
        "            time.sleep(10)\n"
        "        except KeyboardInterrupt:\n"
        "            pass\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "armed\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert err == "error: interrupted\n"
