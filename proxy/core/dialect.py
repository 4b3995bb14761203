"""The core's contract with the wire dialects: what a dialect provides, and what the core gives it.

A dialect (chat completions, text completions, the Responses API, Anthropic
Messages) is one package under ``proxy.dialects`` that exports a ``Dialect``;
this module is the core's, so that the core depends on no dialect.
The core (``proxy.serving.serve``: intake, limits, admission, the engine client,
delivery, metrics, the request log) calls it at three points and never asks
which dialect it serves:

1. ``Dialect.parse(body)`` decodes and validates the request body into a
   ``Job`` (raises ``proxy.errors.InvalidRequest`` naming the field);
2. ``Job.submits(request_id, context)`` converts it into the worker's
   ``Submit``s (usually through ``proxy.core.task``) and fixes the ``Options`` the
   core's ``Generation`` runs with;
3. ``Job.frames(generation, header)`` is the stream encoder (SSE events with the
   dialect's ``event:`` names and terminator, errors inside the stream in its
   shape), ``Job.body(generation, header)`` the non-stream body.

Errors before a stream starts are rendered with ``Dialect.errors``
(``proxy.errors.ErrorShape``). Every error a client sees names the client's own
field: the core and the worker name fields by the wire's (chat completions')
names, and the core renames them once, by ``Dialect.fields`` (``proxy.errors.FieldNames``),
whichever layer raised the error. Whether progress is sent is the core's too:
``Job.stream`` and ``Job.return_progress``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from aiohttp import web

from protocol.messages import Submit
from proxy.core.fields import SamplerFields
from proxy.core.generation import Frames, Generation, Options
from proxy.core.task import ChatTask, chat_submit, tool_plan
from proxy.errors import SAME_NAMES, ErrorShape, FieldNames
from proxy.tools import FormatChoice


@dataclass(frozen=True, slots=True)
class Context:
    """What the conversion needs from the server: the worker's context size in
    tokens, the tool-call format for the served model, and the served model name."""

    max_context_tokens: int
    tool_format: FormatChoice
    model: str
    reasoning_field: str = "reasoning_content"
    """Chat completions' field for the thinking (``ProxySettings.reasoning_field``)."""


@dataclass(frozen=True, slots=True)
class Header:
    """The fields every event and the body of one response repeat: its ``id``
    (the dialect's prefix + 32 hex digits), ``created`` (Unix seconds) and the
    served ``model`` name."""

    id: str
    created: int
    model: str


_R = TypeVar("_R", bound=SamplerFields)


class RequestJob(Generic[_R]):
    """What every dialect's ``Job`` starts from: its parsed request ``req``
    (a ``proxy.core.fields.SamplerFields``), whose ``stream`` and
    ``return_progress`` the core reads."""

    __slots__ = ("req",)

    def __init__(self, req: _R) -> None:
        self.req = req

    @property
    def stream(self) -> bool:
        return self.req.stream

    @property
    def return_progress(self) -> bool:
        return self.req.return_progress


class Job(Protocol):
    """One parsed request of a dialect."""

    @property
    def stream(self) -> bool:
        """The client asked for an SSE stream."""
        ...

    @property
    def return_progress(self) -> bool:
        """The client asked for ``prompt_progress``/``queue_progress`` (sent
        only on a stream: the core decides)."""
        ...

    def submits(self, request_id: str, context: Context) -> tuple[list[Submit], Options]:
        """The worker messages of this request and the core's options for its
        ``Generation`` (``Options.progress`` is set by the core). Raises
        ``InvalidRequest``."""
        ...

    def frames(self, generation: Generation, header: Header) -> Frames:
        """The stream encoder of this request."""
        ...

    def body(self, generation: Generation, header: Header) -> bytes:
        """The non-stream JSON body. Call when ``generation.done``."""
        ...


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Dialect:
    """A wire dialect: ``name`` (for logs and docs: ``chat``, ``completions``,
    ``responses``, ``messages``), the prefix of its response ids (``chatcmpl-``,
    ``cmpl-``, ``resp_``, ``msg_``), its error shape, the parser of its
    generation endpoint's body (raises ``InvalidRequest``), and any further
    routes of its own (method, path, handler; they answer errors in the
    dialect's shape too), and its names for the wire's fields in errors."""

    name: str
    id_prefix: str
    errors: ErrorShape
    parse: Callable[[bytes], Job]
    extra_routes: tuple[tuple[str, str, Handler], ...] = ()
    fields: FieldNames = SAME_NAMES


def chat_submits(task: ChatTask, request_id: str, context: Context) -> tuple[list[Submit], Options]:
    """``Job.submits`` of a conversation, the same for every chat-shaped
    dialect: its tools plan, its one ``Submit``, and the core's options
    (logprobs when the task has them, the tools when they can be called).
    Raises ``InvalidRequest``."""
    plan = tool_plan(task, context.tool_format)
    submit = chat_submit(task, request_id, context.max_context_tokens, plan)
    options = Options(
        logprobs=task.sampling.logprobs is not None,
        tools=plan if plan is not None and plan.config.active else None,
        reasoning_field=context.reasoning_field,
    )
    return [submit], options
