"""What ``benchmarks/proxy_load.py`` relies on: the synthetic engine's stamps, and
the load generator's parsing of what it recorded (no timing here)."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from benchmarks import loadgen
from benchmarks.proxy_load import top_entries
from engine_worker.admission import checked_prepare
from engine_worker.settings import WorkerSettings
from engine_worker.synthetic import STAMP, STAMP_WORD, SyntheticBackend, expected_text, strip_stamps
from protocol import ChatMessage, SamplingParams, Submit, TokenDelta


def run_backend(content: str, max_tokens: int, tokens_per_step: int = 1) -> str:
    settings = WorkerSettings(
        backend="synthetic", synthetic_step_ms=0, synthetic_tokens_per_step=tokens_per_step
    )
    backend = SyntheticBackend(settings)
    submit = Submit("r", SamplingParams(max_tokens), messages=(ChatMessage("user", content),))
    prepared = checked_prepare(backend, submit)
    backend.start("r", prepared, submit.params)
    text = []
    while backend.active_ids():
        text += [ev.text for ev in backend.step() if isinstance(ev, TokenDelta)]
    return "".join(text)


def test_stamped_tokens_carry_their_step_and_strip_back_to_the_expected_text() -> None:
    content = f"{STAMP_WORD} a b"
    words = loadgen.expected_words(content)
    text = run_backend(content, 7, tokens_per_step=2)
    stamps = [int(m.group(1)) for m in STAMP.finditer(text)]
    assert len(stamps) == 7
    assert stamps == sorted(stamps)
    assert stamps[0] == stamps[1] != stamps[2]  # two tokens per step, one stamp per step
    assert strip_stamps(text) == expected_text(words, 7)


def test_without_the_stamp_word_the_output_is_unchanged() -> None:
    content = "plain words here"
    assert run_backend(content, 5) == expected_text(loadgen.expected_words(content), 5)


def chunked(events: list[bytes]) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events)
    return head + body + b"0\r\n\r\n"


def sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def test_every_event_gets_the_time_of_the_read_that_completed_it() -> None:
    content = loadgen.stream_content(3)
    words = loadgen.expected_words(content)
    tokens = [f"{words[k % len(words)]}@{1000 + k} " for k in range(3)]
    events = [
        *(sse({"choices": [{"index": 0, "delta": {"content": t}}]}) for t in tokens),
        sse({"choices": [], "usage": {"prompt_tokens": len(words), "completion_tokens": 3}}),
        b": ping\n\n",
        b"data: [DONE]\n\n",
    ]
    raw = chunked(events)
    # Cut the bytes at awkward places: inside a chunk header, inside an event.
    cuts = [5, 130, 131, 200, 260, len(raw)]
    reads = [
        (10_000_000 + 1_000_000 * i, raw[a:b])
        for i, (a, b) in enumerate(zip([0, *cuts[:-1]], cuts, strict=True))
    ]
    check = loadgen.check_stream(reads, content, 3)
    assert check.ok, check.problem
    assert check.tokens == 3
    parsed = loadgen.parse_response(reads)
    ends = [raw.index(e) + len(e) - 1 for e in events if e.startswith(b"data: ")]
    for ev, end in zip(parsed.events, ends, strict=True):
        expected = next(t for (t, _), b in zip(reads, cuts, strict=True) if end < b)
        assert ev.arrived_ns == expected
    # latency = arrival (us) - stamp
    assert check.latencies_us == [
        ev.arrived_ns // 1000 - (1000 + k) for k, ev in enumerate(parsed.events[:3])
    ]


def test_a_wrong_or_short_stream_is_a_failure() -> None:
    content = loadgen.stream_content(1)
    words = loadgen.expected_words(content)
    wrong = sse({"choices": [{"index": 0, "delta": {"content": "intruder@5 "}}]})
    usage = sse({"choices": [], "usage": {"prompt_tokens": len(words), "completion_tokens": 1}})
    check = loadgen.check_stream([(0, chunked([wrong, usage, b"data: [DONE]\n\n"]))], content, 1)
    assert not check.ok and "text differs" in (check.problem or "")
    right = sse({"choices": [{"index": 0, "delta": {"content": f"{words[0]}@5 "}}]})
    check = loadgen.check_stream([(0, chunked([right, usage]))], content, 1)
    assert not check.ok and check.problem == "no [DONE]"
    check = loadgen.check_stream([(0, b"HTTP/1.1 503 Service Unavailable\r\n\r\n{}")], content, 1)
    assert not check.ok and "503" in (check.problem or "")


def test_profile_summary_counts_only_the_serving_samples(tmp_path: Path) -> None:
    raw = tmp_path / "p.txt"
    raw.write_text(
        "main (cli.py:1);import_module (importlib.py:9) 50\n"
        "main (cli.py:1);run_forever (base_events.py:2);write (libc.so.6) 30\n"
        "main (cli.py:1);run_forever (base_events.py:2);feed (streaming.py:5) 10\n"
    )
    top = top_entries(raw)
    assert top["own"][0] == ("write (libc.so.6)", 75.0)
    assert ("feed (streaming.py)", 25.0) in top["own"]
    assert all("import_module" not in f for f, _ in top["total"])


def named(name: str, obj: dict[str, object]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **obj}) + b"\n\n"


def dialect_events(api: str, tokens: list[str], prompt_tokens: int) -> tuple[list[bytes], bytes]:
    """A whole stream of ``tokens`` in ``api``'s events, and its end event apart."""
    n = len(tokens)
    if api == "responses":
        usage = {"input_tokens": prompt_tokens, "output_tokens": n}
        return (
            [
                named("response.created", {"response": {}}),
                *(named("response.output_text.delta", {"delta": t}) for t in tokens),
                b": ping\n\n",
            ],
            # max_tokens reached, as every synthetic stream ends
            named("response.incomplete", {"response": {"usage": usage}}),
        )
    # Anthropic's usage: the prompt is input_tokens plus the cache counts.
    usage = {"input_tokens": prompt_tokens - 2, "cache_read_input_tokens": 2, "output_tokens": n}
    return (
        [
            named("message_start", {"message": {"usage": {}}}),
            named("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            *(
                named("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": t}})
                for t in tokens
            ),
            named("ping", {}),
            named("content_block_stop", {"index": 0}),
            named("message_delta", {"delta": {"stop_reason": "max_tokens"}, "usage": usage}),
        ],
        named("message_stop", {}),
    )


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_each_dialect_is_checked_in_its_own_events(api: str) -> None:
    content = loadgen.stream_content(2)
    words = loadgen.expected_words(content)
    tokens = [f"{words[k % len(words)]}@{1000 + k} " for k in range(3)]
    events, end = dialect_events(api, tokens, len(words))
    check = loadgen.check_stream([(5_000_000, chunked([*events, end]))], content, 3, api=api)
    assert check.ok, check.problem
    assert check.stamps_us == [1000, 1001, 1002]
    assert check.latencies_us == [5_000 - stamp for stamp in check.stamps_us]
    # As chat: the wrong text, a missing end, a usage that does not count every token.
    wrong = [e.replace(words[0].encode() + b"@1000", b"intruder@1000") for e in events]
    assert "text differs" in (
        loadgen.check_stream([(0, chunked([*wrong, end]))], content, 3, api=api).problem or ""
    )
    short = loadgen.check_stream([(0, chunked(events))], content, 3, api=api)
    assert short.problem == "no end of stream"
    bad_events, bad_end = dialect_events(api, tokens, len(words) + 1)
    bad = loadgen.check_stream([(0, chunked([*bad_events, bad_end]))], content, 3, api=api)
    assert "usage differs" in (bad.problem or "")
    # The request each dialect sends.
    body = orjson.loads(loadgen.APIS[api].body(content, 3, model="m"))
    assert body["stream"] is True and body["model"] == "m"
    assert (body.get("max_output_tokens") or body.get("max_tokens")) == 3
