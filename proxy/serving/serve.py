"""The one request path every dialect's generation endpoint runs through.

``endpoint(dialect)`` is the aiohttp handler of a dialect's generation route
(``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/messages``). In order, each step before the next costs anything:

1. intake (``proxy.server.intake``): media type, admission (not draining), body size
   and read time; the API key was checked by ``proxy.app``'s middleware;
2. the dialect parses and validates the body (``Dialect.parse``), then converts
   it into ``Submit``s (``Job.submits``), both in a thread when the body is large
   (``off_loop``);
3. this server's limits: ``max_n`` choices, prompt texts no longer than the
   context can hold at ``Ready.longest_token_chars`` per token (refused without
   being sent); images, for a model that takes them, checked in a thread
   (``proxy.core.images.check_images``); each grammar checked off the event
   loop, bounded in time and memory (``proxy.grammar.check.validate``);
4. one of the ``max_in_flight`` slots, then the worker (``EngineClient.submit``);
5. delivery (``proxy.serving.delivery``): the SSE stream through the dialect's encoder,
   or the dialect's JSON body once every choice finished.

Disconnects: the server runs with ``handler_cancellation=True``, so a client
that goes away cancels its handler wherever it waits (a silent prefill
included); every exit path sends ``Abort`` for the choices that did not finish.
The request's record (``proxy.ops.request_log``) gets its id, its counts and its
finish; the dialect never touches it. From its submit to its end the request is
listed in ``proxy.ops.inflight`` (``GET /v1/status``, traces).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import msgspec
from aiohttp import web

from protocol.messages import Ready, Submit, choice_ids
from proxy.core.dialect import Context, Dialect, Handler, Header
from proxy.core.generation import Generation
from proxy.core.images import check_images
from proxy.core.task import prompt_chars
from proxy.errors import (
    NOT_READY_MESSAGE,
    OPENAI_ERRORS,
    ContextLengthExceeded,
    EngineNotReady,
    ErrorShape,
    FieldNames,
    InvalidRequest,
    ProxyError,
    error_response,
)
from proxy.grammar.check import validate
from proxy.ops.inflight import INFLIGHT
from proxy.ops.request_log import record_of
from proxy.server.intake import (
    KEY_DIGEST,
    body_limit,
    check_json_body,
    max_prompt_chars,
    read_body,
    too_large,
)
from proxy.server.state import STATE, ProxyState
from proxy.serving.delivery import complete_response, send_body, stream_response


def context_of(state: ProxyState, worker: Ready) -> Context:
    """What a dialect's conversion needs from the server now."""
    return Context(
        worker.max_context_tokens,
        state.tool_format(),
        state.model_name() or worker.model_id,
        state.settings.reasoning_field,
    )


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """The ``expect_handler`` of every route that reads a body: ``Expect:
    100-continue`` is answered ``100 Continue`` only for a body this server would
    read; a ``Content-Length`` over the body limit gets its 413 at once, in the
    route's error shape, before the client sends it (RFC 9110 §10.1.1: a server
    may answer with a final status instead). aiohttp runs this before the
    middlewares and the handler; a response returned here is the answer."""
    expect = request.headers.get("Expect", "")
    if request.version != (1, 1):
        return None  # HTTP/1.0 has no interim responses: the body just comes
    if expect.lower() != "100-continue":
        return web.Response(status=417, text=f"Unknown Expect: {expect[:64]}")
    state = request.app[STATE]
    limit = body_limit(state.settings, state.engine.worker)
    length = request.content_length
    if length is not None and length > limit:
        resp = error_response(too_large(limit, state.settings), error_shape(request))
        resp.force_close()  # the body it announced is not read
        return resp
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the interim response is not the response's size
    return None


async def read_request(request: web.Request) -> bytes:
    """Intake: media type, admission and the body within its limits. Raises ``ProxyError``."""
    state = request.app[STATE]
    check_json_body(request)
    state.check_admissible()
    limit = body_limit(state.settings, state.engine.worker)
    return await read_body(request, limit, state.settings)


def ready_worker(state: ProxyState) -> Ready:
    """The worker's handshake, or ``EngineNotReady``."""
    worker = state.engine.worker
    if worker is None or not state.engine.ready:
        raise EngineNotReady(NOT_READY_MESSAGE)
    return worker


ERROR_SHAPES: web.AppKey[dict[str, ErrorShape]] = web.AppKey("error_shapes", dict)
"""Route pattern -> the error shape of the dialect that owns it (routes of no
dialect use OpenAI's envelope)."""


def add_dialect_routes(app: web.Application, routes: Sequence[tuple[str, Dialect]]) -> None:
    """Register each dialect's generation route (``path``) and its further
    routes, and their error shapes in ``app[ERROR_SHAPES]``. Every error a
    dialect's route raises before its response starts names the field in the
    dialect's terms (``Dialect.fields``); a worker error inside a stream is
    renamed by its ``Generation`` (``Options.fields``)."""
    shapes: dict[str, ErrorShape] = {}
    for path, dialect in routes:
        app.router.add_post(path, renaming(endpoint(dialect), dialect.fields), expect_handler=expect_continue)
        shapes[path] = dialect.errors
        for method, extra, handler in dialect.extra_routes:
            app.router.add_route(
                method, extra, renaming(handler, dialect.fields), expect_handler=expect_continue
            )
            shapes[extra] = dialect.errors
    app[ERROR_SHAPES] = shapes


def renaming(handler: Handler, fields: FieldNames) -> Handler:
    """``handler`` with the ``ProxyError``s it raises renamed by ``fields``."""
    if not fields.names:
        return handler

    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProxyError as e:
            raise fields.rename(e) from None

    handle.__name__ = handle.__qualname__ = handler.__name__
    return handle


def error_shape(request: web.Request) -> ErrorShape:
    """The error shape of the dialect that owns ``request``'s route (OpenAI's
    envelope for every other route)."""
    shapes = request.app.get(ERROR_SHAPES)
    if shapes is None:
        return OPENAI_ERRORS
    resource = request.match_info.route.resource
    if resource is not None and resource.canonical in shapes:
        return shapes[resource.canonical]
    # An unknown route or method under a dialect's path (GET /v1/messages,
    # /v1/messages/batches) answers in that dialect's shape too.
    path = request.path
    under = [p for p in shapes if path == p or path.startswith(p.rstrip("/") + "/")]
    return shapes[max(under, key=len)] if under else OPENAI_ERRORS


def endpoint(dialect: Dialect) -> Handler:
    """The handler of ``dialect``'s generation route."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await serve(request, dialect)

    handle.__name__ = handle.__qualname__ = f"{dialect.name}_endpoint"
    return handle


async def serve(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    """Serve one generation request of ``dialect`` (module docstring)."""
    state = request.app[STATE]
    settings = state.settings
    body = await read_request(request)
    job = await parsed(dialect.parse, body)
    worker = ready_worker(state)
    context = context_of(state, worker)
    request_id = dialect.id_prefix + uuid.uuid4().hex
    record = record_of(request)
    record.request_id = request_id
    record.stream = job.stream
    submits, options = await off_loop(len(body) > PARSE_INLINE_BYTES, job.submits, request_id, context)
    if settings.cache_isolation == "key" and KEY_DIGEST in request:
        submits = [salted(s, request[KEY_DIGEST]) for s in submits]
    check_limits(submits, settings.max_n, worker)
    submits = await check_images(submits, worker, settings.image_limits())
    await check_grammars(submits)
    # What every dialect shares is decided here once: progress only on a stream.
    options = dataclasses.replace(options, progress=job.stream and job.return_progress, fields=dialect.fields)
    header = Header(request_id, int(time.time()), context.model)
    ids = [rid for s in submits for rid in choice_ids(s.request_id, s.n)]
    gen = Generation(ids, options)
    state.admit()
    try:
        stream = state.engine.submit(*submits)
        state.active.add(stream)
        tracked = request.app[INFLIGHT].open(
            request, request_id, context.model, dialect.name, job.stream, gen, record
        )
        failure: BaseException | None = None
        try:
            if job.stream:
                frames = job.frames(gen, header)
                return await stream_response(request, settings, stream, gen, frames, record)
            reply = await complete_response(
                stream, gen, lambda: job.body(gen, header), settings.request_idle_timeout
            )
        except BaseException as e:
            failure = e
            raise
        finally:
            request.app[INFLIGHT].close(tracked, failure)
            state.active.discard(stream)
            if gen.done:
                record.complete(gen.final_counts(), gen.finished(), gen.first_token_at)
            unfinished = gen.unfinished_ids()
            if unfinished:
                state.engine.abort(unfinished)
    finally:
        state.release()
    return await send_body(request, reply, settings.stalled_client_timeout, record)


PARSE_INLINE_BYTES = 256 * 1024
"""Bodies up to this size are parsed and converted on the event loop; larger ones
(images in base64, long conversations) in a thread, so that decoding tens of MiB
of JSON and base64 takes turns with the streams the loop serves instead of
stalling them (30 requests of 8 images each, 40 MiB bodies, held ``/health`` for
up to 2.9 s while their base64 was decoded on the loop)."""

_T = TypeVar("_T")

_CONVERTER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="convert")
"""The one thread large bodies are parsed and converted in. One: this work holds the
GIL in long C calls (JSON, base64), and each thread more doing it is one more the
loop waits behind for the GIL (six threads made the stalls longer, not shorter)."""


async def off_loop(large: bool, fn: Callable[..., _T], *args: object) -> _T:
    """``fn(*args)``: on the loop, or in ``_CONVERTER`` where the input is ``large``."""
    if not large:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_CONVERTER, fn, *args)


async def parsed(parse: Callable[[bytes], _T], body: bytes) -> _T:
    """``parse(body)``, in a thread for a body over ``PARSE_INLINE_BYTES``."""
    return await off_loop(len(body) > PARSE_INLINE_BYTES, parse, body)


async def check_grammars(submits: Sequence[Submit]) -> None:
    """Each distinct grammar of ``submits`` checked off the event loop, bounded
    (``proxy.grammar.check.validate``). Raises ``InvalidRequest`` naming its field."""
    for grammar, param in dict.fromkeys((s.params.grammar, s.params.grammar_param or "") for s in submits):
        if grammar is not None:
            await validate(grammar, param)


def salted(submit: Submit, key_digest: bytes) -> Submit:
    """``submit`` with a salt of its API key's digest (and of its own salt), so
    that its prefix-cache entries are shared with requests of that key only
    (``cache_isolation: key``)."""
    own = (submit.cache_salt or "").encode()
    salt = hashlib.sha256(key_digest + b"\0" + own).hexdigest()
    return msgspec.structs.replace(submit, cache_salt=salt)


def check_limits(submits: list[Submit], max_n: int, worker: Ready) -> None:
    """This server's limits on a valid request: ``max_n`` choices (over all
    prompts of a prompt list), then ``check_prompt`` for each prompt."""
    choices = sum(s.n for s in submits)
    if choices > max_n:
        what = f"'n' is {submits[0].n}" + (f" for each of {len(submits)} prompts" if len(submits) > 1 else "")
        raise InvalidRequest(
            f"{what}; this server runs at most max_n={max_n} choices per request",
            param="n" if len(submits) == 1 else "prompt",
        )
    for i, submit in enumerate(submits):
        check_prompt(submit, worker, f"prompt[{i}]" if len(submits) > 1 else None)


def check_prompt(submit: Submit, worker: Ready, param: str | None = None) -> None:
    """What is known of a prompt before it is tokenized, held against the
    context of ``worker``: no more turns than it has tokens (every chat
    template writes at least one token per turn: a role header or separator),
    and no more characters than its tokens can hold (at most
    ``Ready.longest_token_chars`` each; tools and tool calls counted, as the
    template writes them). Generation and the lookups (``/tokenize``,
    ``count_tokens``) refuse the same prompts, before the worker sees them.
    ``param`` overrides the field named (``prompt[i]`` of a prompt list).
    Raises ``ContextLengthExceeded``."""
    context = worker.max_context_tokens
    if len(submit.messages) > context:
        raise ContextLengthExceeded(
            f"The conversation has {len(submit.messages)} messages; no more than {context} fit this "
            f"model's context of {context} tokens (each message takes at least one token)",
            param="messages",
        )
    most = max_prompt_chars(worker)
    if most is None:
        return
    chars, own = prompt_chars(submit)
    if chars > most:
        raise ContextLengthExceeded(
            f"The prompt has {chars} characters; no text over {most} characters fits this "
            f"model's context of {context} tokens (a token is at most "
            f"{worker.longest_token_chars} characters)",
            param=param or own,
        )
