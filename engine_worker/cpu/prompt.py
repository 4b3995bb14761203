"""The CPU engine's prompts: a ``Submit`` rendered with the model's chat template
(``messages``) or taken as written (``prompt``), tokenized so that only the
template's own control tokens are control tokens (``engine_worker.client_text``),
and the ids that end a sequence."""

from __future__ import annotations

from typing import Any

from engine_worker.backend import RequestRejected
from engine_worker.client_text import ControlTokens, control_tokens
from engine_worker.reasoning import template_kwargs
from engine_worker.requests.turns import template_turns
from protocol.messages import ErrorCode, Submit

# Special tokens that end an assistant turn or a document in common chat
# templates (ChatML, Llama 3, Gemma, Phi-3); only those the tokenizer has count.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|end|>")
# and the document end of GPT-2-style vocabularies, which raw completions emit
_END_OF_TEXT_TOKENS = ("<|endoftext|>",)


def end_ids(tokenizer: Any, generation_config: Any, text_config: Any, vocab_size: int) -> frozenset[int]:
    """The ids that end a sequence: the EOS of the tokenizer, the generation config and
    the model config, and the end-of-turn and end-of-text tokens the tokenizer has."""
    ids: set[int] = set()
    for source in (
        tokenizer.eos_token_id,
        getattr(generation_config, "eos_token_id", None),
        text_config.eos_token_id,
    ):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    special = set(tokenizer.all_special_tokens)
    for name in (*_END_OF_TURN_TOKENS, *_END_OF_TEXT_TOKENS):
        if name in special:
            token_id = tokenizer.convert_tokens_to_ids(name)
            if isinstance(token_id, int) and token_id >= 0:
                ids.add(token_id)
    return frozenset(i for i in ids if 0 <= i < vocab_size)


class PromptRenderer:
    """Token ids of a request's prompt with ``tokenizer``, a Hugging Face tokenizer
    that only the prepare thread uses."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._control_tokens = ControlTokens(control_tokens(tokenizer))

    @property
    def chat_template(self) -> str | None:
        template = self._tokenizer.chat_template
        return template if isinstance(template, str) else None

    def text_prefix_ids(self) -> list[int]:
        """What the tokenizer puts before plain text with its special tokens on: ``[BOS]`` or nothing."""
        bos = self._tokenizer.bos_token_id
        empty = self._tokenizer("", add_special_tokens=True)["input_ids"]
        return [bos] if isinstance(bos, int) and list(empty[:1]) == [bos] else []

    def tokenize(self, submit: Submit, budget: int | None = None) -> tuple[list[int], str]:
        """Prompt token ids and the request field they came from; ``budget`` (thinking
        tokens) may switch the template's thinking off (``reasoning.template_kwargs``).
        Raises ``RequestRejected`` (``INVALID_REQUEST``) for messages the template
        refuses, a model without a template, or ``add_bos`` without a BOS token."""
        tokenizer = self._tokenizer
        if submit.messages and submit.prompt is not None:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, "send either messages or prompt, not both")
        if submit.prompt is not None:
            # The caller's own template: its control tokens' text is parsed as such. Without
            # BOS (add_bos False) nothing is added, and a BOS the text itself writes stays.
            added = submit.add_bos is not False
            raw = [int(i) for i in tokenizer(submit.prompt, add_special_tokens=added)["input_ids"]]
            return self._bos(raw, submit.add_bos), "prompt"
        if not submit.messages:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, "messages is empty", param="messages")
        if tokenizer.chat_template is None:
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, "this model has no chat template; use prompt", param="messages"
            )
        guard = self._control_tokens.guard()
        # This engine passes no tools to its template (ModelInfo.template_tools is off).
        conversation = template_turns(submit, tool_fields=False)
        try:
            extra = template_kwargs(submit.template_kwargs_json, tokenizer.chat_template, budget)
        except ValueError as exc:
            raise RequestRejected(ErrorCode.INVALID_REQUEST, str(exc), param="chat_template_kwargs") from exc
        try:
            text = tokenizer.apply_chat_template(
                guard.escape(conversation),
                add_generation_prompt=submit.add_generation_prompt,
                tokenize=False,
                **guard.escape(extra),
            )
            pieces = guard.pieces(text)
        except Exception as exc:  # the template itself rejects e.g. unsupported roles
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, f"the chat template rejected the messages: {exc}", param="messages"
            ) from exc
        # The call's opening the proxy wrote for a named tool (Submit.forced_prefix).
        pieces += self._control_tokens.prefix_pieces(submit.forced_prefix)
        # Control tokens only where the template (or the proxy's prefix) wrote them;
        # the rest, client text included, with special-token parsing off
        # (engine_worker.client_text).
        texts = [p.text for p in pieces if not p.control]
        encoded = iter(
            tokenizer(texts, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            if texts
            else []
        )
        ids: list[int] = []
        for piece in pieces:
            if piece.control:
                ids.append(int(tokenizer.convert_tokens_to_ids(piece.text)))
            else:
                ids += (int(i) for i in next(encoded))
        return ids, "messages"

    def _bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        """A raw prompt's ids with (``True``) a leading BOS; ``None`` or ``False``: as
        the tokenizer made them (``False`` tokenized with nothing added, so a BOS the
        text writes stays, as ExLlamaV3's ``encode(add_bos=False)`` keeps it). Raises
        ``RequestRejected`` for ``True`` when the model has no BOS token."""
        bos = self._tokenizer.bos_token_id
        if not add_bos:
            return ids
        if not isinstance(bos, int):
            raise RequestRejected(
                ErrorCode.INVALID_REQUEST, "this model has no BOS token", param="add_bos_token"
            )
        return ids if ids[:1] == [bos] else [bos, *ids]
