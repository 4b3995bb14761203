"""The chat client's numbers and the pacing of its plain lines, without a server."""

from __future__ import annotations

import io

import pytest

from launcher.chat.apis import chat_counts, messages_counts, responses_counts
from launcher.chat.plain import PREFILL_LINE_INTERVAL_S, PlainView
from launcher.chat.stats import Counts, Prefill, summarize, usage_text
from launcher.chat.wire import (
    CompletionTokensDetails,
    InputTokensDetails,
    MessagesUsage,
    OutputTokensDetails,
    PromptProgress,
    PromptTokensDetails,
    QueueProgress,
    ResponsesUsage,
    Usage,
    chunk_decoder,
)


def test_prefill_rate_counts_only_the_computed_tokens() -> None:
    p = Prefill.of(PromptProgress(total=10_000, cache=4_000, processed=6_000, time_ms=500))
    rate = (6_000 - 4_000) / 0.5
    assert p.rate_tok_s == pytest.approx(rate)
    assert p.eta_s == pytest.approx((10_000 - 6_000) / rate)
    assert not p.done


@pytest.mark.parametrize(
    ("processed", "time_ms"),
    [(4_000, 0), (4_000, 120)],  # the first chunk (nothing computed yet), a stall
)
def test_no_rate_before_a_token_is_computed(processed: int, time_ms: int) -> None:
    p = Prefill.of(PromptProgress(total=10_000, cache=4_000, processed=processed, time_ms=time_ms))
    assert p.rate_tok_s is None and p.eta_s is None


def test_a_full_cache_hit_is_done_without_a_rate() -> None:
    p = Prefill.of(PromptProgress(total=300, cache=300, processed=300, time_ms=0))
    assert p.done and p.rate_tok_s is None and p.eta_s is None


COUNTS = Counts(
    prompt_tokens=2_000, completion_tokens=101, cached_tokens=1_500, drafts_accepted=30, drafts_rejected=20
)


@pytest.mark.parametrize(
    "counts",
    [
        chat_counts(
            Usage(
                prompt_tokens=2_000,
                completion_tokens=101,
                prompt_tokens_details=PromptTokensDetails(cached_tokens=1_500),
                completion_tokens_details=CompletionTokensDetails(
                    accepted_prediction_tokens=30, rejected_prediction_tokens=20
                ),
            )
        ),
        responses_counts(
            ResponsesUsage(
                input_tokens=2_000,  # the whole prompt, as OpenAI counts it
                output_tokens=101,
                input_tokens_details=InputTokensDetails(cached_tokens=1_500),
                output_tokens_details=OutputTokensDetails(30, 20),
            )
        ),
        messages_counts(
            MessagesUsage(
                input_tokens=300,  # Anthropic: neither read from nor written to the cache
                output_tokens=101,
                cache_creation_input_tokens=200,
                cache_read_input_tokens=1_500,
                accepted_prediction_tokens=30,
                rejected_prediction_tokens=20,
            )
        ),
    ],
    ids=["chat", "responses", "messages"],
)
def test_each_apis_usage_means_the_same_counts(counts: Counts) -> None:
    assert counts == COUNTS


def test_summary_times_and_drafts() -> None:
    s = summarize(COUNTS, sent_at=10.0, first_token_at=11.5, last_token_at=13.5, finish_reason="stop")
    assert s.ttft_s == pytest.approx(1.5)
    assert s.decode_tok_s == pytest.approx(100 / 2.0)
    assert (s.drafts_accepted, s.drafts_verified) == (30, 50)
    assert usage_text(s) == (
        "prompt 2000 (cached 1500, 75%), completion 101, drafts accepted 30/50 (60%), "
        "ttft 1.50 s, decode 50.0 tok/s"
    )


def test_summary_leaves_out_what_was_not_reported() -> None:
    s = summarize(chat_counts(Usage(prompt_tokens=5, completion_tokens=1)), 0.0, 0.25, 0.25, None)
    assert usage_text(s) == "prompt 5, completion 1, ttft 0.25 s"
    assert usage_text(summarize(None, 0.0, None, None, None)) == "not reported by the server"


def test_unknown_fields_and_types_of_other_servers_decode() -> None:
    # llama.cpp: numeric error code, timings, float time_ms; OpenAI: extra usage details.
    c = chunk_decoder.decode(
        b'{"choices":[{"index":0,"delta":{"content":"x","reasoning_content":null},"finish_reason":null}],'
        b'"timings":{"prompt_n":3},"prompt_progress":{"total":9,"cache":0,"processed":9,"time_ms":12.5},'
        b'"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10,'
        b'"completion_tokens_details":{"reasoning_tokens":0}}}'
    )
    assert c.choices[0].delta.content == "x"
    assert c.prompt_progress == PromptProgress(total=9, cache=0, processed=9, time_ms=12.5)
    assert c.usage is not None and c.usage.completion_tokens_details is not None


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_prefill_lines_are_paced_and_the_last_always_shows() -> None:
    clock = FakeClock()
    err = io.StringIO()
    view = PlainView(io.StringIO(), err, clock)
    step = PREFILL_LINE_INTERVAL_S / 4
    total = 40
    for i in range(total + 1):  # one progress chunk every quarter interval
        clock.now = i * step
        view.prefill(Prefill.of(PromptProgress(total=total, cache=0, processed=i, time_ms=i * step * 1000)))
    view.prefill(
        Prefill.of(PromptProgress(total=total, cache=0, processed=total, time_ms=total * step * 1000))
    )
    lines = err.getvalue().splitlines()
    # The first chunk, then one per interval (every 4th chunk), and the 100% line once.
    shown = [int(line.split()[1].split("/")[0]) for line in lines]
    assert shown == list(range(0, total + 1, 4))
    assert lines[-1].startswith(f"prefill: {total}/{total} tokens")


def test_queue_lines_only_when_the_place_changes() -> None:
    err = io.StringIO()
    view = PlainView(io.StringIO(), err)
    for position, queued, t in [(2, 3, 0), (2, 3, 250), (2, 4, 500), (1, 4, 750)]:
        view.queued(QueueProgress(position=position, queued=queued, time_ms=t))
    assert err.getvalue().splitlines() == [
        "queued: position 2 of 3, waited 0.0 s",
        "queued: position 2 of 4, waited 0.5 s",
        "queued: position 1 of 4, waited 0.8 s",
    ]
