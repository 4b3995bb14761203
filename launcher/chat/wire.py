"""What an OpenAI-compatible server sends the chat client, as msgspec structs.

Only the fields the client reads are declared; every other field is ignored, so
chunks from llama.cpp's server, vLLM, OpenAI or this project decode alike. The
extensions (``queue_progress``, ``prompt_progress``, the draft counters) are
optional: a server that sends none of them still decodes.
"""

from __future__ import annotations

import msgspec


class QueueProgress(msgspec.Struct, frozen=True):
    """This project's ``queue_progress``: the request waits in the server's queue.

    ``position``: 1-based place among the waiting requests; ``queued``: requests
    waiting; ``time_ms``: milliseconds since the request was queued; ``eta_ms``:
    estimated milliseconds until it starts, only when the server can tell.
    """

    position: int
    queued: int
    time_ms: float
    eta_ms: float | None = None


class PromptProgress(msgspec.Struct, frozen=True):
    """llama.cpp's ``prompt_progress``: prefill of the prompt, in tokens.

    ``total``: prompt length; ``cache``: tokens reused from the prefix cache;
    ``processed``: tokens in the KV cache so far, the cached ones included (from
    ``cache`` up to ``total``); ``time_ms``: milliseconds since prefill started.
    """

    total: int
    cache: int
    processed: int
    time_ms: float


class Delta(msgspec.Struct, frozen=True):
    """``choices[i].delta``: ``content`` is the next piece of answer text, or null."""

    role: str | None = None
    content: str | None = None


class Choice(msgspec.Struct, frozen=True):
    index: int = 0
    delta: Delta = msgspec.field(default_factory=Delta)
    finish_reason: str | None = None


class PromptTokensDetails(msgspec.Struct, frozen=True):
    """``cached_tokens``: prompt tokens reused from the prefix cache."""

    cached_tokens: int | None = None


class CompletionTokensDetails(msgspec.Struct, frozen=True):
    """Speculative decoding: drafted tokens the target model confirmed / discarded.

    OpenAI sends both as 0 on every response (they count Predicted Outputs there).
    """

    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None


class Usage(msgspec.Struct, frozen=True):
    """Token counts of the whole request (``prompt_tokens`` includes the cached part)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class ErrorBody(msgspec.Struct, frozen=True):
    """The inside of OpenAI's error envelope. llama.cpp sends ``code`` as the HTTP status number."""

    message: str = ""
    type: str | None = None
    param: str | None = None
    code: str | int | None = None


class ErrorEnvelope(msgspec.Struct, frozen=True):
    """``{"error": {...}}``: the body of an HTTP error, or one event once a stream has started."""

    error: ErrorBody


class Chunk(msgspec.Struct, frozen=True):
    """One ``chat.completion.chunk`` event (or an error event, then ``error`` is set).

    Progress chunks carry one choice with no content; the usage chunk has
    ``choices == []``.
    """

    choices: list[Choice] = []
    usage: Usage | None = None
    queue_progress: QueueProgress | None = None
    prompt_progress: PromptProgress | None = None
    error: ErrorBody | None = None


class Model(msgspec.Struct, frozen=True):
    id: str


class ModelList(msgspec.Struct, frozen=True):
    """``GET /v1/models``: ``{"object": "list", "data": [{"id": ...}, ...]}``."""

    data: list[Model] = []


chunk_decoder = msgspec.json.Decoder(Chunk)
error_decoder = msgspec.json.Decoder(ErrorEnvelope)
models_decoder = msgspec.json.Decoder(ModelList)
