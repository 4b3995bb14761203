"""What a server sends the chat client, as msgspec structs, for each API it speaks:
chat completions (OpenAI's ``chat.completion.chunk``), the Responses API's stream
events and Anthropic's Messages stream events.

Only the fields the client reads are declared; every other field is ignored, so
chunks from llama.cpp's server, vLLM, OpenAI, Anthropic or this project decode
alike. The extensions (``queue_progress``, ``prompt_progress``, the draft
counters) are optional: a server that sends none of them still decodes.
Sources: the OpenAI API reference (chat completions streaming, Responses
streaming events), Anthropic's API reference ("Streaming Messages"), this
project's ``docs/http-contract.md``.
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
    """``choices[i].delta``: ``content`` is the next piece of answer text, or null;
    ``reasoning_content`` (``reasoning`` under vLLM's name) the thinking's."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


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
    """``{"error": {...}}``: the body of an HTTP error, or one event once a stream has started.
    Anthropic's error body (``{"type": "error", "error": {"type", "message"}}``) decodes too."""

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


# ---------------------------------------------------------------- Responses API


class InputTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int | None = None


class OutputTokensDetails(msgspec.Struct, frozen=True):
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None


class ResponsesUsage(msgspec.Struct, frozen=True):
    """``response.usage``: ``input_tokens`` is the whole prompt, cached part included."""

    input_tokens: int = 0
    output_tokens: int = 0
    input_tokens_details: InputTokensDetails | None = None
    output_tokens_details: OutputTokensDetails | None = None


class IncompleteDetails(msgspec.Struct, frozen=True):
    reason: str | None = None


class ResponseError(msgspec.Struct, frozen=True):
    code: str | None = None
    message: str = ""


class ResponseObject(msgspec.Struct, frozen=True):
    """The ``response`` of the lifecycle events (``response.completed`` ...)."""

    status: str | None = None
    usage: ResponsesUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None


class ResponsesEvent(msgspec.Struct, frozen=True):
    """Any Responses stream event, by its ``type``: ``response.output_text.delta``
    and ``response.reasoning_text.delta`` (``delta``: text),
    ``response.queue_progress`` / ``response.prompt_progress`` (this project's),
    ``response.completed`` / ``response.incomplete`` / ``response.failed``
    (``response``), ``error`` (``code``, ``message``, ``param``).
    ``delta`` is any JSON: other events' deltas need not be text."""

    type: str = ""
    delta: object = None
    response: ResponseObject | None = None
    queue_progress: QueueProgress | None = None
    prompt_progress: PromptProgress | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None


# ---------------------------------------------------------------- Anthropic Messages


class MessagesUsage(msgspec.Struct, frozen=True):
    """``message.usage`` of ``message_start``, and ``usage`` of ``message_delta``
    (whose fields, when present, replace the first ones). The whole prompt is
    ``input_tokens + cache_creation_input_tokens + cache_read_input_tokens``;
    the draft counters are this project's."""

    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None


class StartedMessage(msgspec.Struct, frozen=True):
    usage: MessagesUsage | None = None


class MessagesDelta(msgspec.Struct, frozen=True):
    """``delta`` of ``content_block_delta`` (``type``: ``text_delta`` with ``text``,
    ``thinking_delta`` with ``thinking``, or another kind) and of ``message_delta`` (``stop_reason``)."""

    type: str | None = None
    text: str | None = None
    stop_reason: str | None = None
    thinking: str | None = None


class MessagesEvent(msgspec.Struct, frozen=True):
    """Any Messages stream event, by its ``type``: ``message_start`` (``message``),
    ``queue_progress`` / ``prompt_progress`` (this project's), ``content_block_delta``
    and ``message_delta`` (``delta``; ``usage`` on the latter), ``message_stop``,
    ``ping``, ``error`` (``error``: ``{"type", "message"}``)."""

    type: str = ""
    message: StartedMessage | None = None
    delta: MessagesDelta | None = None
    usage: MessagesUsage | None = None
    queue_progress: QueueProgress | None = None
    prompt_progress: PromptProgress | None = None
    error: ErrorBody | None = None


chunk_decoder = msgspec.json.Decoder(Chunk)
responses_event_decoder = msgspec.json.Decoder(ResponsesEvent)
messages_event_decoder = msgspec.json.Decoder(MessagesEvent)
error_decoder = msgspec.json.Decoder(ErrorEnvelope)
models_decoder = msgspec.json.Decoder(ModelList)
