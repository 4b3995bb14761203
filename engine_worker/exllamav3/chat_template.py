"""The model's chat template, loaded and checked once, before the weights.

ExLlamaV3 1.6.5 renders chat through ``Tokenizer.hf_chat_template``, which
creates a ``transformers.AutoTokenizer`` the first time it is called, without
``trust_remote_code`` (``tokenizer/tokenizer.py:866-867``). Left to that, the
first chat request pays the tokenizer load, and a model whose template cannot
load answers every chat request with 400 while the worker looks ready. Here the
tokenizer is loaded at start-up (``trust_remote_code`` as configured) and put
where ``hf_chat_template`` looks for it (``Tokenizer.hf_tokenizer``, set to
``None`` at ``tokenizer/tokenizer.py:86``), and a one-message conversation is
rendered once: a model without a usable template stops the worker with one
line (``ChatTemplateError``).

Chat is rendered to text here and tokenized in pieces (``chat_encoder``): the
template's control tokens as control tokens, all client text as text
(``engine_worker.client_text``), which 1.6.5's ``hf_chat_template`` cannot do (it
tokenizes the whole rendered prompt with special tokens parsed,
``tokenizer/tokenizer.py:870-876``).

The template also tells how an assistant turn ends (``<|im_end|>``,
``<|eot_id|>``, ``<end_of_turn>``): ``turn_end`` finds that text by rendering a
short conversation, and the loader makes it a stop condition, because a model's
EOS list does not always name it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from engine_worker.client_text import ControlTokens, control_tokens
from protocol.messages import PromptPiece

Render = Callable[[list[dict[str, str]], bool], str]
"""``(messages, add_generation_prompt) -> prompt text``."""

PROBE: list[dict[str, str]] = [{"role": "user", "content": "Hi"}]
_MARKER = "Exl3SidecarTurnProbe"
_MAX_TURN_END_CHARS = 32


class ChatTemplateError(ValueError):
    """The model directory has no chat template the worker can render."""


def load_hf_tokenizer(directory: Path, *, trust_remote_code: bool) -> Any:
    """``transformers.AutoTokenizer`` for ``directory``, the object
    ``Tokenizer.hf_chat_template`` renders with. Raises ``ChatTemplateError``."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    except Exception as e:
        hint = ""
        if not trust_remote_code and "trust_remote_code" in str(e):
            hint = " (its tokenizer is custom code: pass --trust-remote-code if you trust the directory)"
        raise ChatTemplateError(
            f"{directory}: transformers cannot load the tokenizer that renders the chat template{hint}: "
            f"{type(e).__name__}: {e}"
        ) from e


def source(hf_tokenizer: Any) -> str | None:
    """The template's Jinja source (``Ready.chat_template``): the default one when the
    tokenizer has several named templates; ``None`` when there is none."""
    template = getattr(hf_tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) and template else None


def renderer(hf_tokenizer: Any) -> Render:
    def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, not text")
        return text

    return render


TurnImages = Sequence[Sequence[tuple[int, Any]]]
"""Per message, its images as ``(offset in the content, embedding)``; an embedding is
1.6.5's ``MMEmbedding`` (``engine_worker.exllamav3.vision``)."""

EncodeChat = Callable[
    [
        list[dict[str, Any]],
        bool,
        list[Any] | None,
        Sequence[PromptPiece],
        dict[str, Any] | None,
        TurnImages | None,
    ],
    Any,
]
"""``EngineHandle.encode_chat``: ``(messages, add_generation_prompt, tools, prefix, extra, images)
-> (1, n) ids``; ``extra``: more template variables (``chat_template_kwargs``), escaped as client
text; ``images``: ``TurnImages`` or ``None``."""


def chat_encoder(hf_tokenizer: Any, tokenizer: Any, as_ids: Callable[[list[int]], Any]) -> EncodeChat:
    """``EngineHandle.encode_chat`` over ``hf_tokenizer`` (renders the template, names
    the control tokens) and ExLlamaV3's ``tokenizer``; ``as_ids`` makes the ``(1, n)``
    tensor of a list of ids.

    Client text (every string of ``messages`` and ``tools``) is escaped before
    rendering (``client_text``); each piece of the rendered prompt is then encoded
    with 1.6.5's ``Tokenizer.encode(text, add_bos=False, add_eos=False,
    encode_special_tokens=False, ...)`` (``tokenizer/tokenizer.py:445-452``):
    ``encode_special_tokens=True`` only for a control token the template wrote.
    ``False`` sets the ``tokenizers`` backend's split-special-tokens mode, so a
    special token's text in the input is encoded as text (docstring at ``467-469``,
    ``encode_part_base`` at ``362-368``). Non-special added tokens are split out
    in both modes (``369-389``). ``prefix`` (``Submit.forced_prefix``) follows the
    rendered prompt, its markers control tokens where the tokenizer has them
    (``ControlTokens.prefix_pieces``). Raises what the template raises, and
    ``client_text.TemplateMangled``.

    Images: each one's place is marked in its message's content
    (``ClientText.with_images``), the template renders the content as the text it
    is, and the image's ids (``token_list_at`` of the prompt position it lands on,
    its start and end tokens included) go where the mark is. 1.6.5's own way puts
    the embedding's ``text_alias`` in the text and has ``encode`` split every
    piece of text on the aliases (``tokenizer/tokenizer.py:416-438``), so a
    client that typed an alias (``<$EMB_1000000000$>``) would put another
    request's image in its prompt; here no text ever stands for an image."""
    controls = ControlTokens(control_tokens(hf_tokenizer))

    def encode_chat(
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[Any] | None,
        prefix: Sequence[PromptPiece] = (),
        variables: dict[str, Any] | None = None,
        images: TurnImages | None = None,
    ) -> Any:
        guard = controls.guard()
        extra = guard.escape(dict(variables or {}))
        if tools is not None:
            extra["tools"] = guard.escape(tools)
        escaped = guard.escape(messages)
        placed: list[Any] = []  # the embeddings, in the order their places were marked
        for i, turn_images in enumerate(images or ()):
            if turn_images:
                escaped[i] = {
                    **escaped[i],
                    "content": guard.with_images(messages[i]["content"], [at for at, _ in turn_images]),
                }
                placed += (e for _, e in turn_images)
        text = hf_tokenizer.apply_chat_template(
            escaped, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, not text")
        ids: list[int] = []
        for piece in [*guard.pieces(text), *controls.prefix_pieces(prefix)]:
            if piece.image is not None:
                ids += placed[piece.image].token_list_at(len(ids))
                continue
            encoded = tokenizer.encode(piece.text, encode_special_tokens=piece.control).tolist()
            ids += (int(i) for i in (encoded[0] if encoded and isinstance(encoded[0], list) else encoded))
        return as_ids(ids)

    return encode_chat


def check(hf_tokenizer: Any, directory: Path) -> Render:
    """Render ``PROBE`` once; returns the text renderer. Raises ``ChatTemplateError``
    naming ``directory`` when there is no template or it fails on a plain
    conversation."""
    if not getattr(hf_tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"{directory} has no chat template (chat_template in tokenizer_config.json, or "
            "chat_template.jinja): /v1/chat/completions cannot be served"
        )
    render = renderer(hf_tokenizer)
    try:
        text = render(PROBE, True)
    except Exception as e:
        raise ChatTemplateError(
            f"{directory}: the chat template fails on a one-message conversation: {type(e).__name__}: {e}"
        ) from e
    if not text.strip():
        raise ChatTemplateError(f"{directory}: the chat template renders a conversation as empty text")
    return render


def turn_end(render: Render) -> str | None:
    """The text the template puts right after an assistant message (its first
    word, whitespace stripped), or ``None`` when it puts nothing there or cannot
    render a user/assistant pair. Templates that rewrite assistant content (some
    drop reasoning) leave a plain word alone, so a marker word finds the spot."""
    try:
        text = render([*PROBE, {"role": "assistant", "content": _MARKER}], False)
    except Exception:
        return None
    at = text.rfind(_MARKER)
    if at < 0:
        return None
    words = text[at + len(_MARKER) :].split()
    if not words or len(words[0]) > _MAX_TURN_END_CHARS:
        return None
    return words[0]
