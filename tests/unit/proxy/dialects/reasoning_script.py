"""A fake engine script of a reasoning model: thinking deltas, then the answer."""

from __future__ import annotations

from collections.abc import Sequence

from protocol import Channel, Event, Finished, FinishReason, PrefillProgress, Started, Submit, TokenDelta
from tests.fakes.engine_client import Script, Step

THOUGHT = ["Let me", " think."]
ANSWER = ["Yes", "."]


def thinking_script(
    thought: Sequence[str] = THOUGHT,
    answer: Sequence[str] = ANSWER,
    *,
    marker_tokens: int = 2,
    finish: FinishReason = FinishReason.STOP,
    seen: list[Submit] | None = None,
) -> Script:
    """Each choice thinks ``thought`` then answers ``answer``, one token per text, plus
    ``marker_tokens`` uncounted-in-text marker tokens (counted as reasoning); every
    ``Submit`` goes to ``seen``."""

    def script(submit: Submit) -> list[Step]:
        if seen is not None:
            seen.append(submit)
        rid = submit.request_id
        events: list[Event] = [Started(rid, 5, 0), PrefillProgress(rid, 5, 0, 5, 1)]
        events += [TokenDelta(rid, t, 1, channel=Channel.REASONING) for t in thought]
        events += [TokenDelta(rid, t, 1) for t in answer]
        reasoning = len(thought) + marker_tokens
        completion = reasoning + len(answer)
        events.append(
            Finished(rid, finish, 5, 0, completion, None, None, 0.0, 0.01, 0.02, reasoning_tokens=reasoning)
        )
        return events

    return script
