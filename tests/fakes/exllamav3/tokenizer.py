"""The wheel's ``exllamav3/tokenizer/tokenizer.py`` (``Tokenizer``) over a byte-level
vocabulary of 260 ids, with the ChatML and Qwen-style chat templates and the real
``transformers``/``tokenizers`` tokenizers built over the same ids."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .tensor import FakeTensor

if TYPE_CHECKING:
    from .model import Config


BOS, EOS, IM_START, IM_END = 256, 257, 258, 259
SPECIAL_PIECES = {BOS: "<s>", EOS: "</s>", IM_START: "<|im_start|>", IM_END: "<|im_end|>"}
VOCAB_SIZE = 260


def _piece(i: int) -> str:
    if i in SPECIAL_PIECES:
        return SPECIAL_PIECES[i]
    # A lone byte of a multi-byte character decodes to U+FFFD, as byte-level BPE pieces do.
    return chr(i) if i < 0x80 else "\ufffd"


class Tokenizer:
    """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, 256..259 are ``<s>``, ``</s>``,
    ``<|im_start|>``, ``<|im_end|>``. The chat template is ChatML."""

    bos_token_id = BOS
    eos_token_id = EOS
    bos_token = "<s>"
    eos_token = "</s>"
    actual_vocab_size = VOCAB_SIZE
    tokenizer_config_dict: dict[str, Any] = {"add_bos_token": True}  # noqa: RUF012

    def __init__(self, config: Config | None = None, special_pieces: bool = True) -> None:
        self.config = config
        self.special_pieces = special_pieces

    @property
    def tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` of ``tokenizer.json`` (``tokenizer/tokenizer.py:96``): what
        ``create_ll_tokenizer`` serializes for llguidance (``generator/filter/llguidance.py:29``).
        Here the byte-level vocabulary of ``write_hf_tokenizer``."""
        return _hf_tokenizer()

    @staticmethod
    def from_config(config: Config) -> Tokenizer:
        return Tokenizer(config)

    def encode(
        self,
        text: str,
        add_bos: bool = False,
        add_eos: bool = False,
        encode_special_tokens: bool = False,
        return_offsets: bool = False,
        embeddings: list[Any] | None = None,
    ) -> FakeTensor:
        if return_offsets or embeddings:
            raise NotImplementedError
        ids: list[int] = []
        rest = text
        while rest:
            hit = None
            if encode_special_tokens:
                for i, s in SPECIAL_PIECES.items():
                    at = rest.find(s)
                    if at >= 0 and (hit is None or at < hit[0]):
                        hit = (at, i, s)
            if hit is None:
                ids += list(rest.encode("utf-8"))
                break
            at, i, s = hit
            ids += [*rest[:at].encode("utf-8"), i]
            rest = rest[at + len(s) :]
        if add_bos:
            ids.insert(0, BOS)
        if add_eos:
            ids.append(EOS)
        return FakeTensor(ids)

    def decode(self, ids: Any, decode_special_tokens: bool = False) -> Any:
        """Like ``Tokenizer.decode`` (``tokenizer/tokenizer.py:586-627``): a 2-D tensor gives a
        list of strings, a 1-D tensor a string, a Python list a list of each element decoded
        (so a list of ints fails its tensor assertion, as in 1.6.5). Anything with
        ``.tolist()`` stands in for a tensor. Without ``decode_special_tokens`` every EOS, pad
        and above-vocabulary id is removed and other special tokens vanish
        (``tokenizer.py:556-562``)."""
        if isinstance(ids, list):
            return [self.decode(i, decode_special_tokens) for i in ids]
        assert hasattr(ids, "tolist"), "ids must be Tensor"
        rows = ids.tolist()
        if rows and isinstance(rows[0], list):
            return [self._decode(r, decode_special_tokens) for r in rows]
        return self._decode(rows, decode_special_tokens)

    pad_token_id: int | None = None

    @staticmethod
    def _decode(seq: list[int], decode_special_tokens: bool) -> str:
        if not decode_special_tokens:
            pad = Tokenizer.pad_token_id
            seq = [t for t in seq if t != pad and t < VOCAB_SIZE and t != EOS]
        else:
            seq = [t for t in seq if t < VOCAB_SIZE]  # tokenizer.py:567-568: image ids leave no text
        out = bytearray()
        text = ""
        for t in seq:
            if t < 256:
                out.append(t)
            elif decode_special_tokens:
                text += out.decode("utf-8", errors="replace") + SPECIAL_PIECES[t]
                out.clear()
        return text + out.decode("utf-8", errors="replace")

    def get_id_to_piece_list(self, include_special_tokens: bool = False) -> list[str]:
        """Piece per id. Without special tokens, 1.6.5 decodes each id alone, with special
        tokens kept, when ``" t"`` is one token, else after a prefix with them skipped
        (``tokenizer/tokenizer.py:704-725``): special pieces are their text or empty,
        depending on the tokenizer. ``special_pieces=False`` gives the empty kind."""
        if include_special_tokens or self.special_pieces:
            return [_piece(i) for i in range(VOCAB_SIZE)]
        return ["" if i in SPECIAL_PIECES else _piece(i) for i in range(VOCAB_SIZE)]

    hf_tokenizer: Any = None
    """What ``hf_chat_template`` renders with; ``None`` until first use (``tokenizer.py:86``)."""

    def hf_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        embeddings: list[Any] | None = None,
        **template_kwargs: Any,
    ) -> FakeTensor:
        """``tokenizer/tokenizer.py:806-907``: a ``transformers.AutoTokenizer`` of the model
        directory, loaded on first use unless one is set (``866-867``), renders and tokenizes
        (``870-876``). A directory without tokenizer files (the tests' bare model dirs) gets
        ``ChatMLTemplate`` instead, a stand-in with the same ids. ``template_kwargs`` (``tools``)
        go to ``apply_chat_template`` as they are (``tokenizer.py:830-832``, ``870-876``)."""
        if embeddings:
            raise NotImplementedError
        if self.hf_tokenizer is None:
            directory = self.config.directory if self.config is not None else None
            if directory and os.path.exists(os.path.join(directory, "tokenizer.json")):
                from transformers import AutoTokenizer

                self.hf_tokenizer = AutoTokenizer.from_pretrained(directory)
            else:
                self.hf_tokenizer = ChatMLTemplate()
        rendered = self.hf_tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=True,
            **template_kwargs,
        )
        ids = rendered.get("input_ids") if hasattr(rendered, "get") else rendered
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return FakeTensor(ids)


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


QWEN_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant"
    "{% if message.content %}\n{{ message.content }}{% endif %}"
    "{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    "{{ '\\n' }}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A Qwen2.5-style template (trimmed): the ``tools`` as JSON in the system turn, earlier calls
as ``<tool_call>`` blocks, tool results as ``<tool_response>`` user turns."""


class ChatMLTemplate:
    """Stands in for the ``transformers`` tokenizer of a ChatML model over the fake
    vocabulary: ``chat_template`` and ``apply_chat_template`` as ``hf_chat_template`` and the
    worker's start-up check call them. Unknown roles raise, as strict templates do."""

    chat_template = CHATML_TEMPLATE

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        """The special tokens, as a ``transformers`` tokenizer lists them (``AddedToken``s)."""
        from tokenizers import AddedToken

        return {i: AddedToken(s, special=True) for i, s in SPECIAL_PIECES.items()}

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> Any:
        text = ""
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"unknown role {m['role']!r}")
            text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        if not tokenize:
            return text
        ids = Tokenizer().encode(text, encode_special_tokens=True).tolist()[0]
        return {"input_ids": ids} if return_dict else ids


def _byte_symbols() -> list[str]:
    """The printable character byte-level BPE uses for each byte value: bytes that are
    printable Latin-1 stand for themselves, the others are shifted past U+0100."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(0x100 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def write_hf_tokenizer(directory: str, chat_template: str | None = CHATML_TEMPLATE) -> None:
    """Write ``tokenizer.json``/``tokenizer_config.json`` for a real ``transformers`` tokenizer
    with the fake's ids (bytes 0..255, then ``<s>``, ``</s>``, ``<|im_start|>``, ``<|im_end|>``),
    so the worker's start-up path (``AutoTokenizer``, ``apply_chat_template``) runs for real
    over the fake model. ``chat_template=None`` writes none."""
    hf_tokenizer(chat_template).save_pretrained(directory)


def hf_tokenizer(chat_template: str | None = CHATML_TEMPLATE) -> Any:
    """A ``transformers`` fast tokenizer over the fake's ids with ``chat_template``: what the
    worker's loader gets from ``AutoTokenizer`` for a model directory (``write_hf_tokenizer``
    writes it there), for handles built without one."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=_hf_tokenizer(), bos_token="<s>", eos_token="</s>")
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


_HF_TOKENIZER: list[Any] = []


def _hf_tokenizer() -> Any:
    """``tokenizers.Tokenizer``: bytes 0..255 as byte-level BPE pieces, then the special tokens
    ``<s>``, ``</s>``, ``<|im_start|>``, ``<|im_end|>`` (ids 256..259)."""
    if not _HF_TOKENIZER:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        vocab = {sym: b for b, sym in enumerate(_byte_symbols())}
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([SPECIAL_PIECES[i] for i in sorted(SPECIAL_PIECES)])
        _HF_TOKENIZER.append(tok)
    return _HF_TOKENIZER[0]
