"""``RequestStream``: bounded backlog, merging for slow clients, errors as values."""

from __future__ import annotations

import pytest

from protocol import Event, Finished, FinishReason, PrefillProgress, Started, TokenDelta
from proxy.engine.stream import RequestStream
from proxy.errors import EngineDead


async def test_backlog_merges_deltas_beyond_the_cap() -> None:
    s = RequestStream(["a", "b"], max_pending=4)
    texts = [f"t{i}," for i in range(200)]
    s.put(Started("a", 5, 0))
    s.put(Started("b", 5, 0))
    for t in texts:
        s.put(TokenDelta("a", t, 2))
        s.put(TokenDelta("b", t.upper(), 1))
    s.put(Finished("a", FinishReason.STOP, 5, 0, 400))
    events = await s.get()
    assert len(events) <= 4 + 2 + 1
    a_deltas = [e for e in events if isinstance(e, TokenDelta) and e.request_id == "a"]
    b_deltas = [e for e in events if isinstance(e, TokenDelta) and e.request_id == "b"]
    assert "".join(e.text for e in a_deltas) == "".join(texts)
    assert "".join(e.text for e in b_deltas) == "".join(texts).upper()
    assert sum(e.num_tokens for e in a_deltas) == 400
    assert sum(e.num_tokens for e in b_deltas) == 200
    assert isinstance(events[-1], Finished)
    # per request, the order is kept: Started first, Finished after every delta of "a"
    assert next(type(e).__name__ for e in events if e.request_id == "a") == "Started"


async def test_no_merge_below_the_cap() -> None:
    s = RequestStream(["a"], max_pending=10)
    for i in range(5):
        s.put(TokenDelta("a", str(i), 1))
    assert [e.text for e in await s.get() if isinstance(e, TokenDelta)] == ["0", "1", "2", "3", "4"]


async def test_progress_merge_keeps_the_start_and_the_latest() -> None:
    s = RequestStream(["a"], max_pending=2)
    s.put(Started("a", 100, 10))
    for p in (10, 30, 50, 70, 100):
        s.put(PrefillProgress("a", 100, 10, p, p))
    events = await s.get()
    assert [e.processed for e in events if isinstance(e, PrefillProgress)] == [10, 100]


async def test_failure_after_pending_events() -> None:
    s = RequestStream(["a"], max_pending=8)
    s.put(Started("a", 1, 0))
    s.fail(EngineDead("gone"))
    s.put(TokenDelta("a", "late", 1))  # ignored after fail
    assert s.failed
    events: list[Event] = await s.get()
    assert events == [Started("a", 1, 0)]
    with pytest.raises(EngineDead, match="gone"):
        await s.get()


async def test_get_times_out_with_nothing() -> None:
    s = RequestStream(["a"], max_pending=8)
    assert await s.get(0.01) == []
