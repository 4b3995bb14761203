"""``Tokenize`` and ``Detokenize``: answered on a thread of their own, so a
generation request's preparation never waits behind them, and sent in arrival
order. Each is bounded like a generation prompt (``admission.check_prompt_size``;
token ids by the context)."""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from engine_worker.admission import check_images, check_prompt_size
from engine_worker.backend import Backend, RequestRejected
from protocol import Detokenize, Detokenized, ErrorCode, Event, RequestError, Tokenize, Tokens

log = logging.getLogger(__name__)


class Lookups:
    """The lookups of ``backend`` in flight: ``submit`` one, ``collect`` the answers
    that are ready (a ``RequestError`` for one refused or failed)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="worker-lookup")
        self._pending: deque[tuple[str, Future[Event]]] = deque()

    def __bool__(self) -> bool:
        return bool(self._pending)

    def submit(self, msg: Tokenize | Detokenize) -> None:
        if isinstance(msg, Tokenize):
            self._pending.append((msg.submit.request_id, self._pool.submit(self._tokenize, msg)))
        else:
            self._pending.append((msg.request_id, self._pool.submit(self._detokenize, msg)))

    def collect(self, pending: list[Event]) -> None:
        """Append the ``Tokens``/``Detokenized`` answers that are ready, in arrival order."""
        while self._pending and self._pending[0][1].done():
            rid, future = self._pending.popleft()
            try:
                pending.append(future.result())
            except RequestRejected as e:
                pending.append(RequestError(rid, e.code, e.message, e.param))
            except Exception as e:
                log.error("tokenizing for %s failed", rid, exc_info=e)
                pending.append(RequestError(rid, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _tokenize(self, msg: Tokenize) -> Event:
        """``Tokenize``'s answer: the prompt exactly as ``prepare`` makes it for generation
        (a prompt generation refuses untokenized is refused here too), and with
        ``add_special_tokens`` on messages the tokenizer's leading specials before it."""
        submit = msg.submit
        backend = self._backend
        check_prompt_size(submit, backend.info)
        check_images(submit, backend.info)
        # The prompt alone: a grammar or logprobs do not change it, and compiling one (or
        # building the vocabulary) here would race the prepare thread's.
        params = msgspec.structs.replace(submit.params, grammar=None, grammar_param=None, logprobs=None)
        prepared = backend.prepare(msgspec.structs.replace(submit, params=params))
        ids = backend.prompt_ids(prepared)
        if msg.add_special_tokens and submit.prompt is None:
            ids = backend.text_prefix_ids() + ids
        return Tokens(submit.request_id, tuple(ids))

    def _detokenize(self, msg: Detokenize) -> Event:
        context = self._backend.info.max_context_tokens
        if len(msg.token_ids) > context:
            message = f"{len(msg.token_ids)} token ids: a sequence of this model holds at most {context}"
            raise RequestRejected(ErrorCode.CONTEXT_LENGTH_EXCEEDED, message, param="tokens")
        text = self._backend.detokenize(list(msg.token_ids), msg.skip_special_tokens)
        return Detokenized(msg.request_id, text)
