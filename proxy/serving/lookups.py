"""Questions the worker answers without generating: tokenize a prompt, detokenize ids.

Used by vLLM's ``POST /tokenize`` / ``POST /detokenize`` and Anthropic's
``POST /v1/messages/count_tokens``. The worker tokenizes a ``Submit`` exactly
as for generation (chat template, tools, client text as text), so a count
equals the ``prompt_tokens`` the same request would report. Each lookup takes
one of the ``max_in_flight`` slots while it waits, and waits at most
``request_idle_timeout``. What generation refuses before tokenizing is refused
here too, so a lookup costs the worker no more than the largest prompt.
"""

from __future__ import annotations

import uuid

import msgspec
from aiohttp import web

from protocol.messages import Detokenize, Detokenized, RequestError, Submit, Tokenize, Tokens
from proxy.core.images import check_images
from proxy.errors import ContextLengthExceeded, GatewayTimeout, from_request_error
from proxy.server.state import STATE
from proxy.serving.serve import check_prompt, ready_worker


async def _ask(request: web.Request, msg: Tokenize | Detokenize, rid: str) -> Tokens | Detokenized:
    state = request.app[STATE]
    idle_s = state.settings.request_idle_timeout
    state.admit()
    answered = False
    try:
        stream = state.engine.lookup(msg)
        events = await stream.get(idle_s or None)
        for ev in events:
            if isinstance(ev, (Tokens, Detokenized)):
                answered = True
                return ev
            if isinstance(ev, RequestError):
                answered = True
                raise from_request_error(ev)
        raise GatewayTimeout(f"No answer from the engine worker for {idle_s:g} s (request_idle_timeout)")
    finally:
        if not answered:
            state.engine.abort([rid])
        state.release()


async def tokenize(request: web.Request, submit: Submit, add_special_tokens: bool = False) -> tuple[int, ...]:
    """The prompt token ids of ``submit`` (its grammar and logprobs dropped: they
    do not change the prompt); ``add_special_tokens``: ``Tokenize``'s. A prompt
    generation would refuse before tokenizing (``proxy.serving.serve.check_prompt``)
    and its images (``proxy.core.images.check_images``) are refused here the same
    way, before the worker spends time on it. Raises
    ``ProxyError``."""
    state = request.app[STATE]
    worker = ready_worker(state)
    check_prompt(submit, worker)
    (submit,) = await check_images([submit], worker, state.settings.image_limits())
    rid = "tok-" + uuid.uuid4().hex
    params = msgspec.structs.replace(submit.params, grammar=None, grammar_param=None, logprobs=None)
    plain = msgspec.structs.replace(submit, request_id=rid, params=params, n=1)
    answer = await _ask(request, Tokenize(plain, add_special_tokens), rid)
    assert isinstance(answer, Tokens)
    return answer.token_ids


async def detokenize(
    request: web.Request, token_ids: tuple[int, ...], skip_special_tokens: bool = False
) -> str:
    """The text of ``token_ids`` (special tokens included unless
    ``skip_special_tokens``): at most the context's length of them, as no sequence
    of this model holds more. Raises ``ProxyError``."""
    context = ready_worker(request.app[STATE]).max_context_tokens
    if len(token_ids) > context:
        raise ContextLengthExceeded(
            f"'tokens' has {len(token_ids)} ids; this model's context holds at most {context}",
            param="tokens",
        )
    rid = "detok-" + uuid.uuid4().hex
    answer = await _ask(request, Detokenize(rid, token_ids, skip_special_tokens), rid)
    assert isinstance(answer, Detokenized)
    return answer.text
