"""What ``benchmarks/proxy_load.py`` relies on: the synthetic engine's stamps, and
the load generator's parsing of what it recorded (no timing here)."""

from __future__ import annotations

from pathlib import Path

import orjson

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
