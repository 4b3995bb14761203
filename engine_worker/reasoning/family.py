"""The family interface: how a family is recognised in a chat template and bound
to a vocabulary (its markers resolved to ids)."""

from __future__ import annotations

import abc
import logging

from engine_worker.reasoning.base import Parser, Vocab

log = logging.getLogger(__name__)


class Family(abc.ABC):
    """One model family's way of thinking (one module each in this package)."""

    name: str

    @abc.abstractmethod
    def writes_span(self, template: str) -> bool:
        """The chat template writes this family's thinking (automatic choice)."""

    @abc.abstractmethod
    def bind(self, vocab: Vocab, *, single_tokens: bool) -> Parser | None:
        """This family over ``vocab``. With ``single_tokens`` (automatic choice) every
        marker must be one token of the vocabulary, else ``None``; chosen by name, a
        marker the vocabulary lacks as a token is matched as the ids it encodes to."""


def marker_ids(vocab: Vocab, text: str, *, single_tokens: bool) -> tuple[int, ...] | None:
    """``text``'s ids: its one token, or (unless ``single_tokens``) its encoding."""
    token = vocab.token_id(text)
    if token is not None:
        return (token,)
    if single_tokens:
        log.info("reasoning: %r is not one token of this vocabulary", text)
        return None
    ids = tuple(vocab.encode(text))
    return ids or None
