"""The Responses API's objects as this server writes them (``msgspec.Struct``s;
field order is key order on the wire, ``UNSET`` fields are left out).

Source: the OpenAI API reference for ``POST /v1/responses`` (the ``response``
object, its output items, usage and the streaming events). ``prompt_progress``
and ``queue_progress`` events are this server's (``docs/http-contract.md``).

Response::

    {"id": "resp_...", "object": "response", "created_at": int,
     "status": "in_progress" | "completed" | "incomplete" | "failed",
     "error": {"code", "message"} | null,
     "incomplete_details": {"reason": "max_output_tokens"} | null,
     "instructions", "max_output_tokens", "model", "output": [item, ...],
     "parallel_tool_calls", "previous_response_id": null, "reasoning",
     "store": false, "temperature", "text": {"format": ...}, "tool_choice",
     "tools", "top_p", "truncation", "usage": usage | null, "metadata"}

    item: {"type": "message", "id": "msg_...", "status", "role": "assistant",
           "content": [{"type": "output_text", "text", "annotations": [], "logprobs"?}]}
        | {"type": "function_call", "id": "fc_...", "call_id", "name", "arguments", "status"}

    usage: {"input_tokens", "input_tokens_details": {"cached_tokens"},
            "output_tokens", "output_tokens_details": {"reasoning_tokens": 0,
            "accepted_prediction_tokens"?, "rejected_prediction_tokens"?}, "total_tokens"}

(``input_tokens`` is the whole prompt, cached part included, as OpenAI's;
the draft counts have the names chat usage gives them, only when drafting.)
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from proxy.core.progress import PromptProgress, QueuePosition
from proxy.core.usage import Counts
from proxy.dialects.openai.shapes import TokenLogprobOut


class InputTokensDetails(msgspec.Struct, gc=False):
    cached_tokens: int


class OutputTokensDetails(msgspec.Struct, gc=False):
    reasoning_tokens: int = 0
    accepted_prediction_tokens: int | UnsetType = UNSET
    rejected_prediction_tokens: int | UnsetType = UNSET


class ResponseUsage(msgspec.Struct, gc=False):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, c: Counts) -> ResponseUsage:
        details = OutputTokensDetails(c.reasoning_tokens)
        if c.draft_accepted is not None:
            details = OutputTokensDetails(c.reasoning_tokens, c.draft_accepted, c.draft_rejected or 0)
        return cls(
            c.prompt_tokens, InputTokensDetails(c.cached_tokens), c.completion_tokens, details, c.total_tokens
        )


class OutputText(msgspec.Struct, gc=False, tag_field="type", tag="output_text"):
    text: str
    annotations: list[object] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprobOut] | UnsetType = UNSET


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class MessageItem(msgspec.Struct, gc=False, tag_field="type", tag="message"):
    id: str
    status: ItemStatus
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"


class FunctionCallItem(msgspec.Struct, gc=False, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class ReasoningText(msgspec.Struct, gc=False, tag_field="type", tag="reasoning_text"):
    text: str


class ReasoningItem(msgspec.Struct, gc=False, tag_field="type", tag="reasoning"):
    """The thinking of a reasoning model (the SDK's ``ResponseReasoningItem``): its text as
    one ``reasoning_text`` content part; no summary (the model writes none)."""

    id: str
    status: ItemStatus
    content: list[ReasoningText]
    summary: list[object] = msgspec.field(default_factory=list)


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class ResponseError(msgspec.Struct, gc=False):
    code: str
    message: str


class IncompleteDetails(msgspec.Struct, gc=False):
    reason: str


class Reasoning(msgspec.Struct, gc=False):
    effort: str | None = None
    summary: str | None = None


class Response(msgspec.Struct, kw_only=True, gc=False):
    """The ``response`` object (module docstring). Request parameters are
    echoed as the client sent them (or their defaults)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: Reasoning = msgspec.field(default_factory=Reasoning)
    store: bool = False
    temperature: float | None = None
    text: dict[str, Any]
    tool_choice: Any = "auto"
    tools: list[Any] = msgspec.field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)


# ---------------------------------------------------------------- stream events
# Each carries ``type`` (its SSE ``event:`` name too) and ``sequence_number``.


class LifecycleEvent(msgspec.Struct, gc=False):
    """``response.created``, ``response.in_progress``, ``response.completed``,
    ``response.incomplete``, ``response.failed``."""

    type: str
    sequence_number: int
    response: Response


class ItemEvent(msgspec.Struct, gc=False):
    """``response.output_item.added`` / ``.done``."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class PartEvent(msgspec.Struct, gc=False):
    """``response.content_part.added`` / ``.done``."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(msgspec.Struct, gc=False):
    """``response.output_text.delta``."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[TokenLogprobOut]


class ReasoningDeltaEvent(msgspec.Struct, gc=False):
    """``response.reasoning_text.delta`` (the SDK's ``ResponseReasoningTextDeltaEvent``)."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(msgspec.Struct, gc=False):
    """``response.reasoning_text.done``."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class TextDoneEvent(msgspec.Struct, gc=False):
    """``response.output_text.done``."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[TokenLogprobOut]


class ArgumentsDeltaEvent(msgspec.Struct, gc=False):
    """``response.function_call_arguments.delta``."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(msgspec.Struct, gc=False):
    """``response.function_call_arguments.done``."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class PromptProgressEvent(msgspec.Struct, gc=False):
    """``response.prompt_progress`` (this server's; opt-in)."""

    type: str
    sequence_number: int
    prompt_progress: PromptProgress


class QueueProgressEvent(msgspec.Struct, gc=False):
    """``response.queue_progress`` (this server's; opt-in)."""

    type: str
    sequence_number: int
    queue_progress: QueuePosition
