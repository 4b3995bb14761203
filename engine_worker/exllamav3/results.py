"""One ExLlamaV3 job's result dicts into ``protocol.messages`` events: the phases of
a job (queued, prefill, decode), its progress, text and logprobs, the text 1.6.5
holds back at a stop token, and its counters at the end. How each key of 1.6.5's
dicts is read, with the source lines: ``docs/exllamav3.md``, "How iterate() results
become events"."""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from engine_worker.backend import Prepared
from engine_worker.exllamav3 import logprobs as lp
from engine_worker.exllamav3.engine import id_list
from engine_worker.exllamav3.segments import Segment, SegmentSizes
from engine_worker.options.exllamav3 import PAGE_SIZE
from engine_worker.reasoning.text_split import TextSplitter
from engine_worker.requests.events import opening
from engine_worker.requests.stops import StopMatcher
from protocol.messages import (
    Channel,
    ErrorCode,
    Event,
    Finished,
    FinishReason,
    PrefillProgress,
    RequestError,
    TokenDelta,
    TokenLogprob,
)

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    QUEUED = 1  # enqueued, the engine has not allocated pages yet
    PREFILL = 2  # Started sent, prompt being ingested
    DECODE = 3  # closing progress sent, tokens streaming


@dataclass(slots=True)
class JobRecord:
    """One request's job and what has been reported of it."""

    request_id: str
    job: Any
    serial: int  # -1 while held back (not enqueued yet)
    prompt_tokens: int
    reservation: int
    new_job: Callable[[], Any]  # the same job again, for a rebuilt generator
    prepared: Prepared
    segment: Segment
    logprobs: int | None = None  # alternatives per token when the request asked for logprobs
    grammar: Any = None  # the job's grammar filter
    phase: Phase = Phase.QUEUED
    cached: int = 0
    processed: int = 0
    started_at: float = 0.0  # monotonic seconds, start of the iterate() that started the job
    uncredited_tokens: int = 0  # tokens of empty-text dicts, credited to the next TokenDelta
    split: TextSplitter | None = None  # thinking vs answer, with a reasoning parser
    uncredited_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    answer: AnswerText | None = None  # the answer's stop strings and logprobs, with a splitter
    seen_tokens: int = 0  # output tokens in the results so far


class AnswerText:
    """The answer of a reasoning model's job on its way out: the client's ``stops``
    matched in it alone (the Job was not given them, so the thinking never stops a
    request; ``grammar.answer_filter_factory`` ends the job on the same token), and its
    tokens' logprob entries kept with their text as ``engine_worker.requests.logprobs``
    keeps them on the CPU engine: an entry is reported once all its text is let
    through, a delta's text cut at its last reported entry, and at a stop string the
    entries starting before it keep the part shown, the rest are dropped."""

    def __init__(self, stops: tuple[str, ...], min_tokens: int) -> None:
        self._matcher = StopMatcher(stops)
        self._min_tokens = min_tokens
        self._entries: deque[tuple[TokenLogprob, int, int]] = deque()  # entry, its [start, end) of the text
        self._fed = 0  # characters fed
        self._emitted = 0  # characters the matcher let through
        self._reported = 0  # characters sent in deltas
        self._pending = ""  # text from _reported to _emitted
        self._tokens = 0  # answer tokens not credited to a delta yet

    @property
    def stopped(self) -> bool:
        return self._matcher.stopped

    def feed(
        self, text: str, tokens: int, entries: list[TokenLogprob] | None, output_tokens: int, final: bool
    ) -> tuple[str, int, tuple[TokenLogprob, ...] | None]:
        """``text`` of the answer, ``tokens`` answer tokens and their ``entries`` (``None``:
        no logprobs asked; their shares join to ``text``), with ``output_tokens`` of the
        sequence so far (stops are searched from ``min_tokens`` on): the text, token count
        and entries of the delta to send (no text: none yet)."""
        self._tokens += tokens
        if entries is not None:
            at, stop = self._fed, self._fed + len(text)
            for i, e in enumerate(entries):
                # The last entry ends where the text does, whatever the shares said.
                end = stop if i == len(entries) - 1 else min(at + len(e.token), stop)
                self._entries.append((e, at, end))
                at = end
        self._fed += len(text)
        check = output_tokens >= self._min_tokens
        emit, stopped = self._matcher.feed(text, check=check) if text else ("", False)
        if final and not stopped:
            emit += self._matcher.flush()
        self._pending += emit
        self._emitted += len(emit)
        return self._take(final, entries is not None)

    def _take(self, final: bool, scored: bool) -> tuple[str, int, tuple[TokenLogprob, ...] | None]:
        if not scored and not self._entries:
            text, self._pending = self._pending, ""
            self._reported = self._emitted
        else:
            count = 0
            if final:
                cut = self._matcher.stopped
                count = sum(1 for _, start, _ in self._entries if not cut or start < self._emitted)
            else:
                for i, (_, start, end) in enumerate(self._entries):
                    if end > self._emitted:
                        break
                    if end > start:
                        count = i + 1
            out: list[TokenLogprob] = []
            boundary = self._reported
            for _ in range(count):
                e, start, end = self._entries.popleft()
                end = min(end, self._emitted)
                share = self._pending[start - self._reported : end - self._reported]
                out.append(e if share == e.token else msgspec.structs.replace(e, token=share))
                boundary = end
            if final:
                self._entries.clear()
                boundary = self._emitted
            text = self._pending[: boundary - self._reported]
            self._pending = self._pending[boundary - self._reported :]
            self._reported = boundary
            if text or out:
                tokens, self._tokens = self._tokens, 0
                return text, tokens, tuple(out)
            return "", 0, None
        if not text:
            return "", 0, None
        tokens, self._tokens = self._tokens, 0
        return text, tokens, None


def as_int(x: Any) -> int:
    # cached_tokens is an int in 1.6.5; other code paths have produced floats.
    return round(float(x))


class ResultConverter:
    """Converts result dicts of jobs over a model with ``pieces`` (each token's text)
    and ``decode`` (token ids to text); ``token_bytes`` for logprobs, ``sizes`` for the
    reservation of a re-queued job."""

    def __init__(
        self,
        pieces: Sequence[str],
        decode: Callable[[list[int]], str],
        token_bytes: lp.TokenBytes,
        sizes: SegmentSizes,
    ) -> None:
        self._pieces = pieces
        self._decode = decode
        self._token_bytes = token_bytes
        self._sizes = sizes

    def _begin(self, req: JobRecord, now: float, events: list[Event]) -> None:
        pages = as_int(getattr(req.job, "cached_pages", 0))
        cached = pages * PAGE_SIZE + as_int(getattr(req.job, "cached_tokens", 0))
        cached = max(0, min(cached, req.prompt_tokens - 1))
        req.phase = Phase.PREFILL
        req.cached = req.processed = cached
        events += opening(req.request_id, req.prompt_tokens, cached, int((now - req.started_at) * 1000))

    def _progress(self, req: JobRecord, processed: int, now: float, events: list[Event]) -> None:
        if processed <= req.processed:
            return
        req.processed = processed
        ms = int((now - req.started_at) * 1000)
        events.append(PrefillProgress(req.request_id, req.prompt_tokens, req.cached, processed, ms))

    def convert(self, req: JobRecord, r: dict[str, Any], t0: float, now: float, events: list[Event]) -> bool:
        """Append the events of one result dict ``r`` of ``req``'s job, from the
        ``iterate()`` call that began at ``t0`` and returned at ``now`` (monotonic
        seconds); ``True`` when it ended the request (an error or its end)."""
        stage = r.get("stage")
        if stage == "error":
            err = r.get("error")
            log.error("exllamav3: job of %s failed: %r", req.request_id, err)
            events.append(
                RequestError(req.request_id, ErrorCode.INTERNAL, f"engine error: {type(err).__name__}: {err}")
            )
            return True
        if req.phase is Phase.QUEUED:
            if stage == "started" or not req.started_at:
                req.started_at = t0
            if stage == "started":
                return False
            self._begin(req, now, events)
        if stage == "prefill":
            if req.phase is Phase.PREFILL:
                done = min(int(r.get("curr_progress", 0)), req.prompt_tokens - 1)
                self._progress(req, done, now, events)
            return False
        if stage != "streaming":
            return False
        if req.phase is Phase.PREFILL:
            self._progress(req, req.prompt_tokens, now, events)
            req.phase = Phase.DECODE

        if r.get("requeue"):
            # The job re-queues with its sequence so far as the prompt (job.py:879, 1194-1261):
            # it will hold more pages than it was admitted with.
            req.segment = self._sizes.requeued(req.segment)
            req.reservation = self._sizes.tokens(req.segment)
        text = r.get("text") or ""
        ids = id_list(r.get("token_ids"))
        tokens = len(ids)
        eos = bool(r.get("eos"))
        entries = self._logprobs(req, ids, text, r)
        if eos and r.get("eos_reason") == "stop_token":
            held_text, held_ids, held = self._held_before_stop_token(r)
            held_entries = self._logprobs(req, held_ids, held_text, held)
            text += held_text
            tokens += len(held_ids)
            if entries is not None and held_entries is not None:
                entries += held_entries
        if req.split is not None:
            self._split(req, r, ids, text, eos, events)
        elif text:
            tokens += req.uncredited_tokens
            req.uncredited_tokens = 0
            if entries is not None:
                entries = req.uncredited_logprobs + entries
                req.uncredited_logprobs = []
            out = tuple(entries) if entries is not None else None
            last = events[-1] if events else None
            if isinstance(last, TokenDelta) and last.request_id == req.request_id:
                # One speculative pass streams a dict per accepted token: send them as one delta.
                merged = None if out is None else (*(last.logprobs or ()), *out)
                events[-1] = TokenDelta(req.request_id, last.text + text, last.num_tokens + tokens, merged)
            else:
                events.append(TokenDelta(req.request_id, text, tokens, out))
        else:
            req.uncredited_tokens += tokens
            if entries is not None:
                req.uncredited_logprobs += entries
        if eos:
            events.append(self._finished(req, r))
            return True
        return False

    def _split(
        self, req: JobRecord, r: dict[str, Any], ids: list[int], text: str, eos: bool, events: list[Event]
    ) -> None:
        """The thinking and the answer of one result of a reasoning model's job (``text``:
        its text, a stop token's held text included): thinking as it comes, without
        logprobs; the answer through ``AnswerText``."""
        assert req.split is not None and req.answer is not None
        held_text, held_ids, held = "", list[int](), dict[str, Any]()
        if eos and r.get("eos_reason") == "stop_token":
            held_text, held_ids, held = self._held_before_stop_token(r)
        all_ids = [*ids, *held_ids]
        req.seen_tokens += len(all_ids)
        extras: list[TokenLogprob | None] | None = None
        if req.logprobs is not None:
            # Shares of the whole result's text; the splitter keeps the answer tokens' entries.
            shown = text[: len(text) - len(held_text)]
            extras = self._aligned(req, ids, shown, r)
            if held_ids:
                extras += self._aligned(req, held_ids, held_text, held)
        pieces = req.split.feed(all_ids, text, final=eos, extras=extras)
        answered = False
        for channel, part, count in pieces:
            if channel is Channel.REASONING:
                if part:
                    events.append(TokenDelta(req.request_id, part, count, channel=channel))
                continue
            answered = True
            self._answer(req, part, count, eos, events)
        if eos and not answered:
            self._answer(req, "", 0, eos, events)

    def _answer(self, req: JobRecord, text: str, count: int, final: bool, events: list[Event]) -> None:
        assert req.split is not None and req.answer is not None
        entries: list[TokenLogprob] | None = None
        if req.logprobs is not None:
            entries = [e for e in req.split.answer_extras() if isinstance(e, TokenLogprob)]
        if req.answer.stopped:
            return  # past a stop string: the job ends on this token (grammar.answer_filter_factory)
        part, tokens, out = req.answer.feed(text, count, entries, req.seen_tokens, final)
        if part:
            events.append(TokenDelta(req.request_id, part, tokens, out, channel=Channel.CONTENT))

    def _aligned(
        self, req: JobRecord, ids: list[int], text: str, source: dict[str, Any]
    ) -> list[TokenLogprob | None]:
        assert req.logprobs is not None
        shares = lp.split_text(ids, text, self._pieces, self._decode)
        return lp.aligned_entries(
            ids, shares, source, top=req.logprobs, pieces=self._pieces, token_bytes=self._token_bytes
        )

    def _logprobs(
        self, req: JobRecord, ids: list[int], text: str, source: dict[str, Any]
    ) -> list[TokenLogprob] | None:
        """The entries of ``ids``, whose result released ``text`` (``logprobs`` module);
        ``None`` when the request did not ask for logprobs."""
        if req.logprobs is None:
            return None
        shares = lp.split_text(ids, text, self._pieces, self._decode)
        return lp.entries(
            ids, shares, source, top=req.logprobs, pieces=self._pieces, token_bytes=self._token_bytes
        )

    def _held_before_stop_token(self, r: dict[str, Any]) -> tuple[str, list[int], dict[str, Any]]:
        """The text ``Job`` was holding back when a stop token ended it, minus the stop
        token's own piece, the tokens it came from (the stop token left out), and the
        ``held`` dict (whose probabilities start with those tokens')."""
        held = r.get("held") or {}
        text: str = held.get("text") or ""
        ids = id_list(held.get("token_ids"))
        stop_id = r.get("eos_triggering_token_id")
        if ids and ids[-1] == stop_id:
            ids = ids[:-1]
        if not text:
            return "", [], held
        if isinstance(stop_id, int) and 0 <= stop_id < len(self._pieces):
            piece = self._pieces[stop_id]
            if piece and text.endswith(piece):
                text = text[: -len(piece)]
        if "\ufffd" in text and ids:
            # Held because a character was still incomplete: decoding the tokens together
            # repairs characters split across them, as Job does at other EOS reasons
            # (job.py:887-893).
            text = self._decode(ids)
        return text, ids, held

    def _finished(self, req: JobRecord, r: dict[str, Any]) -> Finished:
        reason = FinishReason.LENGTH if r.get("eos_reason") == "max_new_tokens" else FinishReason.STOP
        cached = max(0, min(as_int(r.get("cached_tokens", req.cached)), req.prompt_tokens))
        accepted = r.get("accepted_draft_tokens")
        rejected = r.get("rejected_draft_tokens")
        drafted = accepted is not None or rejected is not None
        fin = Finished(
            request_id=req.request_id,
            finish_reason=reason,
            prompt_tokens=req.prompt_tokens,
            cached_tokens=cached,
            completion_tokens=int(r.get("new_tokens", 0)),
            draft_accepted=int(accepted or 0) if drafted else None,
            draft_rejected=int(rejected or 0) if drafted else None,
            time_queued=float(r.get("time_enqueued", 0.0)),
            time_prefill=float(r.get("time_prefill", 0.0)),
            time_decode=float(r.get("time_generate", 0.0)),
            reasoning_tokens=req.split.splitter.reasoning_tokens if req.split is not None else 0,
        )
        if log.isEnabledFor(logging.DEBUG):
            acc = fin.draft_accepted or 0
            verified = acc + (fin.draft_rejected or 0)
            rate = f"{acc / verified:.0%}" if verified else "n/a"  # 0/0: nothing was drafted
            log.debug(
                "exllamav3: %s done (%s): %d prompt (%d cached), %d completion, draft acceptance %s",
                req.request_id,
                r.get("eos_reason"),
                fin.prompt_tokens,
                fin.cached_tokens,
                fin.completion_tokens,
                rate,
            )
        return fin
