"""The OpenAI (legacy) text completions dialect: ``POST /v1/completions``.

Request: a text ``prompt`` or a list of them (each gets ``n`` choices, indexed
across prompts; token-id prompts are refused), ``logprobs`` (0..20
alternatives per token), ``echo`` (the prompt before each choice's text), the
shared sampling fields; a missing ``max_tokens`` is 16, as OpenAI's. A raw
prompt is the caller's own template: special-token text in it is read as the
tokenizer reads it.

Stream chunk: as chat's (``proxy.dialects.chat.frames``) with ``"object":
"text_completion"`` and the choice ``{"index", "text", "logprobs": {"tokens",
"token_logprobs", "top_logprobs", "text_offset"} | null, "finish_reason"}``.
Body: ``{"id": "cmpl-...", "object": "text_completion", "created", "model",
"choices": [choice], "usage", "timings"?}``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from protocol.messages import Submit
from proxy.core.dialect import Context, Dialect, Header, RequestJob
from proxy.core.fields import Refusals, decode
from proxy.core.generation import Choice, Frames, Generation, Logprobs, Options
from proxy.core.task import TextTask, text_submits
from proxy.dialects.openai.frames import ChunkFrames
from proxy.dialects.openai.request import OpenAIFields
from proxy.dialects.openai.shapes import (
    Completion,
    ResponseChoice,
    TextChoice,
    TextLogprobs,
    Timings,
    usage_of,
)
from proxy.dialects.tabby import ROUTES as TABBY_ROUTES
from proxy.errors import OPENAI_ERRORS, InvalidRequest
from proxy.server import sse
from proxy.server.bodies import encode

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions`` (chat has none)."""


class CompletionRequest(OpenAIFields, kw_only=True):
    """``POST /v1/completions`` body (module docstring)."""

    prompt: str | list[str]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool = False

    def completion_limit(self) -> int:
        return DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    def prompts(self) -> tuple[str, ...]:
        """One prompt for a string, each entry of a list."""
        return (self.prompt,) if isinstance(self.prompt, str) else tuple(self.prompt)


REFUSED: Refusals = {
    "suffix": lambda v: v == "",
    "best_of": lambda v: v == 1,
}


def parse_completion_request(body: bytes) -> CompletionRequest:
    """Decode and validate a text completions body. Raises ``InvalidRequest``."""
    req = decode(body, CompletionRequest, REFUSED, "/v1/completions")
    if req.echo and req.logprobs is not None:
        raise InvalidRequest(
            "'echo' with 'logprobs' would need the prompt tokens' log-probabilities, which this server "
            "does not compute; ask for one or the other",
            param="echo",
        )
    if isinstance(req.prompt, list) and not req.prompt:
        raise InvalidRequest("'prompt' must be a string or a non-empty list of strings", param="prompt")
    return req


_PROGRESS = TextChoice(0, "")


def _logprobs(entries: Logprobs, offset: int) -> TextLogprobs | None:
    return None if entries is None else TextLogprobs.of(entries, offset)


class TextFrames(ChunkFrames):
    """The text completions stream encoder."""

    __slots__ = ()

    progress_choice = _PROGRESS

    def text(self, choice: Choice, text: str, logprobs: Logprobs, offset: int, out: list[bytes]) -> None:
        out.append(sse.event(self.chunk(TextChoice(choice.index, text, _logprobs(logprobs, offset)))))

    def finish(self, choice: Choice, reason: str, logprobs: Logprobs, out: list[bytes]) -> None:
        c = TextChoice(choice.index, "", _logprobs(logprobs, choice.chars), reason)
        out.append(sse.event(self.chunk(c)))


class CompletionJob(RequestJob[CompletionRequest]):
    """One text completions request."""

    __slots__ = ()

    def submits(self, request_id: str, context: Context) -> tuple[list[Submit], Options]:
        req = self.req
        task = TextTask(
            prompts=req.prompts(),
            sampling=req.sampling(max_tokens=req.completion_limit(), stop=req.stop, logprobs=req.logprobs),
            json_output=req.json_output(),
            n=req.n,
            cache_salt=req.cache_salt,
        )
        submits = text_submits(task, request_id, context.max_context_tokens)
        options = Options(
            logprobs=req.logprobs is not None,
            echo=task.prompts if req.echo else (),
            per_prompt=req.n if len(submits) > 1 else 0,
        )
        return submits, options

    def frames(self, generation: Generation, header: Header) -> Frames:
        req = self.req
        return TextFrames(
            generation,
            header,
            "text_completion",
            include_usage=req.include_usage,
            continuous_usage=req.continuous_usage,
            timings=req.timings_per_token,
        )

    def body(self, generation: Generation, header: Header) -> bytes:
        choices: list[ResponseChoice] = []
        for r in generation.results():
            lp = None
            if r.logprobs is not None:
                # The tokens are the end of the text (an echoed prompt comes before them).
                start = len(r.text) - sum(len(t.token) for t in r.logprobs)
                lp = TextLogprobs.of(r.logprobs, start)
            choices.append(TextChoice(r.index, r.text, lp, r.finish_reason))
        counts = generation.final_counts()
        h = header
        body = Completion(h.id, "text_completion", h.created, h.model, choices, usage_of(counts))
        if self.req.timings_per_token:
            body.timings = Timings.final(counts)
        return encode(body)


COMPLETIONS = Dialect(
    name="completions",
    id_prefix="cmpl-",
    errors=OPENAI_ERRORS,
    parse=lambda body: CompletionJob(parse_completion_request(body)),
    extra_routes=TABBY_ROUTES,
)
"""``POST /v1/completions``, and TabbyAPI's read routes beside it (``proxy.dialects.tabby``)."""
