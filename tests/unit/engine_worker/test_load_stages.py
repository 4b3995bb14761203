"""``LoadReporter``: each stage named when it begins and ends, progress at most once
per ``every`` seconds, every change handed to the listener."""

from __future__ import annotations

import logging

import pytest

from engine_worker.load_stages import LoadReporter, LoadStatus, Stage


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_stages_progress_and_ends_are_logged_and_heard(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    heard: list[LoadStatus] = []
    r = LoadReporter(heard.append, every=1.0, clock=clock)
    assert r.status is None
    with caplog.at_level(logging.INFO, logger="engine_worker.load"):
        r.stage(Stage.QUANTIZE, "quantize weights (int4)", total=30, unit="layers")
        for layer in range(1, 31):
            clock.now += 0.25  # 7.5 s in all: progress at 1, 2, ... 7 s
            r.advance(layer)
        r.stage(Stage.WARM_UP)
        clock.now += 0.5
        r.ready()
    lines = [rec.getMessage() for rec in caplog.records]
    assert lines[0] == "load: quantize weights (int4): started"
    assert lines[1] == "load: quantize weights (int4): 4/30 layers (13%), 1.0 s"
    assert lines[7] == "load: quantize weights (int4): 28/30 layers (93%), 7.0 s"
    assert lines[8:] == [
        "load: quantize weights (int4): done in 7.5 s",
        "load: warm up: started",
        "load: warm up: done in 0.5 s",
        "load: ready",
    ]
    assert [h.stage for h in heard] == [Stage.QUANTIZE] * 8 + [Stage.WARM_UP, Stage.READY]
    assert heard[1] == LoadStatus(Stage.QUANTIZE, 4, 30, 1.0, "quantize weights (int4)", 101.0)


def test_a_stage_shorter_than_every_logs_no_progress(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    r = LoadReporter(every=1.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="engine_worker.load"):
        r.stage(Stage.LOAD_WEIGHTS, total=3)
        for i in range(1, 4):
            clock.now += 0.2
            r.advance(i)
        r.ready()
    assert [rec.getMessage() for rec in caplog.records] == [
        "load: load weights: started",
        "load: load weights: done in 0.6 s",
        "load: ready",
    ]


def test_the_announcer_sends_the_latest_stage_with_its_time_brought_up_to_date() -> None:
    import threading

    from engine_worker.load_stages import LoadAnnouncer
    from protocol import Loading

    clock = Clock()
    sent: list[Loading] = []
    got = threading.Event()
    closed = threading.Event()

    def send(msg: Loading) -> None:
        sent.append(msg)
        got.set()

    announcer = LoadAnnouncer("w1", lambda: (send, closed.set), every=0.05, clock=clock)
    reporter = LoadReporter(announcer.update, clock=clock)
    assert announcer.message() is None
    announcer.start()
    try:
        reporter.stage(Stage.QUANTIZE, "quantize weights (int4)", total=30, unit="layers")
        assert got.wait(5)
        clock.now += 2.0  # no progress for 2 s: the message still says how long
        assert announcer.message() == Loading("w1", "quantize", "quantize weights (int4)", 0, 30, 2000, 2000)
        reporter.ready()
        assert announcer.message() is None  # nothing once ready
    finally:
        announcer.stop()
    assert closed.is_set() and sent[0].stage == "quantize" and sent[0].worker_id == "w1"
