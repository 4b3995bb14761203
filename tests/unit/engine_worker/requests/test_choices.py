"""The one rule both engines start a request's choices by
(``engine_worker.requests.choices.startable``)."""

from __future__ import annotations

from dataclasses import dataclass

from engine_worker.requests.choices import startable


@dataclass(eq=False)
class Seq:
    name: str
    group: str
    state: str  # "waiting", "prefill" or "decode"


def _start(seqs: list[Seq]) -> list[str]:
    return [
        s.name
        for s in startable(
            seqs,
            group=lambda s: s.group,
            waiting=lambda s: s.state == "waiting",
            prefilled=lambda s: s.state == "decode",
        )
    ]


def test_only_the_first_choice_of_a_new_request_starts() -> None:
    seqs = [Seq("a0", "a", "waiting"), Seq("a1", "a", "waiting"), Seq("a2", "a", "waiting")]
    assert _start(seqs) == ["a0"]


def test_later_choices_wait_while_the_first_is_in_prefill_then_all_start() -> None:
    seqs = [Seq("a0", "a", "prefill"), Seq("a1", "a", "waiting"), Seq("a2", "a", "waiting")]
    assert _start(seqs) == []
    seqs[0].state = "decode"
    assert _start(seqs) == ["a1", "a2"]


def test_when_the_first_choice_ends_before_its_prefill_the_next_one_takes_its_place() -> None:
    seqs = [Seq("a1", "a", "waiting"), Seq("a2", "a", "waiting")]  # a0 is gone
    assert _start(seqs) == ["a1"]


def test_requests_do_not_wait_for_each_other() -> None:
    seqs = [
        Seq("a0", "a", "prefill"),
        Seq("a1", "a", "waiting"),
        Seq("b0", "b", "waiting"),
        Seq("c0", "c", "decode"),
        Seq("c1", "c", "waiting"),
    ]
    assert _start(seqs) == ["b0", "c1"]
