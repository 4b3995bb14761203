"""A fake of the exllamav3 1.6.5 surface the worker uses, runnable without CUDA.

It stands in for ``import exllamav3`` (``Config``, ``Model``, ``Cache``,
``CacheLayer_fp16``, ``CacheLayer_quant``, ``Tokenizer``, ``Generator``, ``Job``,
``ComboSampler``) and emits exactly the result dicts of
``Generator.iterate()``, quirks included. It follows the control flow of the
1.6.5 wheel (paths below are under ``exllamav3/``), with a scripted "model"
choosing tokens instead of a network:

- ``iterate()`` (``generator/generator.py:674-836``): start pending jobs, one
  prefill pass per active job (with the shared chunk size and cooldown while
  another job decodes, lines 763-786), then one decode or speculative
  verification pass. Several dicts per job per call: ``"started"``,
  ``"prefill"`` and ``"streaming"`` in one call, and one ``"streaming"`` dict per
  accepted draft position (``generator.py:1897-1913``).
- ``"started"`` when pages are allocated, with ``identifier`` only when the job
  has one (``generator.py:2165-2222``); jobs that do not fit the batch or the
  free pages wait (``generator.py:2189-2192``).
- Paged prefix cache of 256-token pages: prompt pages hashed as a chain
  (``generator/pagetable.py:240-259``), reused by hash at allocation, counted as
  cached when already filled (``pagetable.py:650-673``); pages a sibling job
  filled since are skipped and counted during prefill (``generator/job.py:1424-1436``);
  a token-level match inside the first uncached page copies keys from any page
  with the same predecessor (``job.py:1459-1499``), counted in ``cached_tokens``.
  Unreferenced pages keep their content until evicted. Pages a job reserves
  for new tokens are backed up and, if the job never writes them, restored on
  release (``pagetable.py:112-127``, ``153-177``); any prefill or decode write
  clears that (``job.py:1435,1497,1662``, ``generator.py:1678``). A page missing by
  hash is cleared with no backup (``pagetable.py:140-150``). A completed page
  whose hash another page holds takes over that page if referenced, else clears
  it (``job.py:652-697``).
- MTP (a drafter with ``caps["mtp_draft"]``): the page holding the last prompt
  token is left out of the reusable prefix and allocated fresh
  (``job.py:1329-1333``, ``pagetable.py:291-296``), and the token-level match
  leaves the last prompt token to prefill (``job.py:1476-1479``).
- ``Tokenizer.decode`` wants a tensor (anything with ``.tolist()`` here) and drops
  every EOS, pad and above-vocabulary id (``tokenizer/tokenizer.py:556-562``,
  ``608-613``). ``max_skips=None`` fails with ``TypeError`` once a job is skipped,
  as in 1.6.5 (``generator.py:2196``).
- ``"prefill"`` only when the pass advanced (``job.py:1682-1693``), with
  ``curr_progress`` up to ``len(prompt) - 1``: a fully cached, page-aligned prompt
  emits none (``job.py:1453``).
- Token acceptance (``job.py:781-1191``): stop tokens end the job without
  flushing the held text, which stays in ``"held"`` with the stop token's piece
  (``job.py:978-993``, ``948-962``); ``max_new_tokens`` flushes it; text with an
  incomplete UTF-8 character is held until it completes (``job.py:1005-1016``);
  a partial stop-string match is held, a full one ends the job with the rest in
  ``"held"`` (``job.py:1161-1183``, matching rules of
  ``exllamav3_ext/generator/strings.cpp:partial_strings_match``).
- ``"requeue": True`` when ``max_rq_tokens`` is reached (``job.py:815``,
  ``879``); the job object then re-initialises itself with its sequence as the
  prompt, keeps its serial and held text (``job.py:1194-1261``) and goes to the
  front of the queue (``generator.py:2126-2128``), so it emits ``"started"`` and
  ``"prefill"`` again mid-stream.
- EOS dict keys (``job.py:926-946``), ``accepted_draft_tokens``/
  ``rejected_draft_tokens`` only when the generator drafts (``job.py:942``);
  drafted positions past an EOS count as rejected and the EOS dict is patched
  (``generator.py:1925-1940``); after the first mismatch the rest of the window
  is rejected (``generator.py:1770-1775``, ``1956-1962``).
- A failure inside a job's prefill is contained: the job is dropped and an
  ``"error"`` dict with ``job``/``serial``/``stage``/``eos``/``error`` and no
  ``identifier`` is appended (``generator.py:2135-2162``, ``781-787``).
- ``enqueue`` asserts the job can ever fit, with 1.6.5's message
  (``job.py:1340-1344``), after capping ``max_new_tokens`` to the room left
  (``job.py:1287-1292``).
- ``decode_special_tokens`` picks the piece list of each sampled token
  (``job.py:971``) and the decode that repairs held text (``job.py:887-893``,
  ``1005-1016``), and survives a re-queue (``job.py:1246``); with ``True`` every
  special token is its text (``tokenizer/tokenizer.py:727-736``).
- ``Tokenizer.hf_chat_template`` renders with ``hf_tokenizer``, loading
  ``AutoTokenizer`` from the model directory on first use when none is set
  (``tokenizer/tokenizer.py:86``, ``866-876``); ``write_hf_tokenizer`` writes real
  ``transformers`` tokenizer files with the fake's ids.
- Faults out of ``iterate()``: ``NonFiniteLogits`` on a job's first sample
  (``job.py:21``, ``742-750``); a new ``Generator`` over the same cache supersedes
  the old one, which then drops its jobs and refuses to run (``generator.py:242-245``,
  ``741-749``); ``close()`` leaves model and cache for a replacement
  (``generator.py:839-871``). ``Model.device_error`` (fake-only) stands for a
  sticky CUDA error, which fails every later GPU call.
- ``Cache.layers`` report ``storage_size``/``overhead_size`` as FP16 and quantized
  cache layers compute them (``cache/fp16.py:92-98``, ``cache/quant.py:137-147``).
- Filters: ``Filter``, ``LLGuidanceFilter`` and ``create_ll_tokenizer`` are 1.6.5's
  (``generator/filter/filter.py``, ``llguidance.py``) over the real ``llguidance`` and a
  real ``tokenizers`` vocabulary with the fake's ids (``Tokenizer.tokenizer``). Filters
  are attached and reset when the job starts (``Job.activate``, ``job.py:1764-1773``,
  from ``iterate_start_jobs``, ``generator.py:2204``), not on a re-queue; fed every
  sampled token first (``job.py:807-811``); a completed filter with
  ``eos_after_completed`` ends the job as ``"end_filter"`` after the stop-token and
  ``max_new_tokens`` checks (``job.py:992-1002``). Masks apply to every sampled
  position, drafted ones included, with the filter advanced by the tokens accepted
  before it (``generator.py:1958-1983``): a draft token is accepted only if it equals the
  masked sample. Stop tokens are masked before ``min_new_tokens`` (``job.py:461-462``).
  Under a mask the fake model's choice falls to the allowed token with the lowest id.
- Probabilities: the fake model's raw distribution is ``raw_probs(script choice)``;
  ``return_probs``/``return_top_tokens`` report it whatever the mask, bias or sampler
  settings did (softmax of the raw logits, ``job.py:764-778``), buffered with the held
  tokens and sent with their ``token_ids`` (``job.py:902-907``, ``981-985``), in ``held``
  at a stop token (``job.py:949-961``), carried over a re-queue (``job.py:1217-1219``).
- ``hf_chat_template`` forwards keywords (``tools``) to ``apply_chat_template``
  (``tokenizer/tokenizer.py:830-832``, ``870-876``); ``hf_tokenizer(template)`` makes a
  real ``transformers`` tokenizer with any template (``QWEN_TOOLS_TEMPLATE`` renders tools).

Deliberately stricter than 1.6.5: ``Job``, ``Generator``, ``Cache`` and
``ComboSampler`` take exactly the 1.6.5 parameter names and no ``**kwargs``, so a
(``CustomSampler`` and the ``SS_*`` steps the backend's XTC stack uses record their
arguments; a logit bias of ``-inf`` bans its token, as ``LogitBias`` does)
misspelt keyword fails here instead of being ignored; features the worker does
not use (token healing, banned strings, embeddings, ``return_logits``, loop
detection, recurrent models) raise ``NotImplementedError``. N-gram drafting follows 1.6.5's
suffix automaton (``_SuffixAutomaton``); the drafting *model* is the script, so acceptance
rates are the fake model's, not a real one's.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import json
import math
import os
import struct
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine_worker.exllamav3.sampling import xtc_sampler

PAGE_SIZE = 256
__version__ = "1.6.5+fake"

# ---------------------------------------------------------------- tensors


class FakeTensor:
    """``(1, n)`` token ids, or ``(n,)`` with ``flat=True``; the backend uses only ``.shape``
    and ``.tolist()``, like a ``torch.LongTensor``."""

    def __init__(self, ids: Sequence[int], flat: bool = False) -> None:
        self._ids = [int(i) for i in ids]
        self.flat = flat

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self._ids),) if self.flat else (1, len(self._ids))

    def tolist(self) -> list[int] | list[list[int]]:
        return list(self._ids) if self.flat else [list(self._ids)]

    def __repr__(self) -> str:
        return f"FakeTensor({self._ids})"


class FakeArray:
    """A nested list with ``.shape`` and ``.tolist()``: the probability tensors of a result
    dict (``token_probs`` ``(1, n)``, ``top_k_tokens``/``top_k_probs`` ``(1, n, k)``)."""

    def __init__(self, data: list[Any]) -> None:
        self._data = data

    @property
    def shape(self) -> tuple[int, ...]:
        shape: list[int] = []
        x: Any = self._data
        while isinstance(x, list):
            shape.append(len(x))
            x = x[0] if x else None
        return tuple(shape)

    def tolist(self) -> list[Any]:
        return json.loads(json.dumps(self._data))

    def __repr__(self) -> str:
        return f"FakeArray({self._data})"


def _ids_of(t: Any) -> list[int]:
    """Token ids of a FakeTensor, a torch tensor of shape (n,) or (1, n), or a list."""
    rows = t.tolist() if hasattr(t, "tolist") else list(t)
    if rows and isinstance(rows[0], list):
        assert len(rows) == 1, "input_ids must be [1, seq_len]"
        rows = rows[0]
    return [int(i) for i in rows]


# ---------------------------------------------------------------- tokenizer

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


# ---------------------------------------------------------------- scripted models

Script = Callable[[Sequence[int], Sequence[int]], int]
"""``(prompt_ids, generated_ids) -> next token id``: the fake model's greedy choice.
``prompt_ids`` is the prompt of the client's request (not of a requeued segment)."""


def reply(text: str | bytes | Sequence[int], then: int = IM_END) -> Script:
    """Answer every prompt with ``text`` (UTF-8 bytes or ids), then ``then`` forever."""
    ids = list(text.encode("utf-8") if isinstance(text, str) else text)

    def script(prompt: Sequence[int], generated: Sequence[int]) -> int:
        n = len(generated)
        return ids[n] if n < len(ids) else then

    return script


def by_prompt(default: Script, **scripts: Script) -> Script:
    """Use ``scripts[key]`` when ``key`` occurs in the decoded prompt, else ``default``."""

    def script(prompt: Sequence[int], generated: Sequence[int]) -> int:
        text = Tokenizer._decode(list(prompt), True)
        for key, s in scripts.items():
            if key in text:
                return s(prompt, generated)
        return default(prompt, generated)

    return script


class Config:
    """``Config.from_directory`` (``model/config.py:259``): reads ``config.json``.

    Fake-only keys: ``"fake_mtp": true`` gives the model an MTP component."""

    def __init__(self, directory: str, config_dict: dict[str, Any]) -> None:
        self.directory = directory
        self.config_dict = config_dict
        self.architecture = config_dict["architectures"][0]
        self.max_position_embeddings = int(config_dict.get("max_position_embeddings", 8192))
        eos = config_dict.get("eos_token_id", EOS)
        self.eos_token_id_list = list(eos) if isinstance(eos, list) else [eos]
        self.eos_token_id = self.eos_token_id_list[0]
        self.vocab_size = int(config_dict.get("vocab_size", VOCAB_SIZE))
        self.model_classes: dict[str, type[Model]] = {"text": Model}
        if config_dict.get("fake_mtp"):
            self.model_classes["mtp"] = Model
        self.dynamic_seq_len: int | None = None
        self.script: Script | None = None

    @staticmethod
    def from_directory(directory: str) -> Config:
        with open(os.path.join(directory, "config.json"), encoding="utf8") as f:
            d = json.load(f)
        assert "architectures" in d, f"No architecture defined in {directory}/config.json"
        return Config(directory, d)

    def override_dynamic_seq_len(self, new_max_position_embeddings: int) -> None:
        self.dynamic_seq_len = new_max_position_embeddings


DEFAULT_SCRIPT = reply("Hello from the fake model.")

RAW_LOGIT_FIRST = 8.0
RAW_LOGIT_SECOND = 6.0


def raw_probs(choice: int) -> list[float]:
    """The fake model's output distribution over ids ``0 .. VOCAB_SIZE - 1`` when its script
    chooses ``choice``: logit ``RAW_LOGIT_FIRST`` for ``choice``, ``RAW_LOGIT_SECOND`` for
    ``(choice + 1) % VOCAB_SIZE``, 0 for every other id; the padded ids past the vocabulary get
    ``-inf`` (``sampler/custom.py:1206-1207``). Softmax at temperature 1, as
    ``Job.receive_logits`` computes ``token_probs``/``top_k_probs`` (``job.py:767-776``)."""
    logits = [0.0] * VOCAB_SIZE
    logits[choice] = RAW_LOGIT_FIRST
    logits[(choice + 1) % VOCAB_SIZE] = max(logits[(choice + 1) % VOCAB_SIZE], RAW_LOGIT_SECOND)
    peak = max(logits)
    weights = [math.exp(x - peak) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def top_k(probs: Sequence[float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely ``(id, prob)``, most likely first; ties in id order (``torch.sort``
    leaves their order unspecified)."""
    return sorted(enumerate(probs), key=lambda t: (-t[1], t[0]))[:k]


DOMINANT_BIAS = 1e4
"""A logit bias at least this large makes the fake model choose that token."""


class NonFiniteLogits(RuntimeError):
    """``generator/job.py:21``: NaN/Inf logits on a job's first sample."""


class Model:
    """A model whose next token is ``script(prompt, generated)``. ``fail_prefill(prompt)``
    returning True makes prefill raise for that job (to produce ``"error"`` results);
    ``nonfinite(prompt)`` returning True makes that job's first sample raise
    ``NonFiniteLogits`` out of ``iterate()`` (``job.py:742-750``: ``receive_logits`` is
    called from the batched decode, which does not contain it). ``device_error``, once set,
    stands for a sticky CUDA error: every later GPU call raises it (``iterate`` here, and
    ``make_handle``'s ``check_device``)."""

    warmup_failures: tuple[str, ...] = ()
    """What ``warmup`` returns: labels of passes that raised (tests set it)."""

    def __init__(
        self,
        config: Config | None = None,
        component: str = "text",
        script: Script | None = None,
        fail_prefill: Callable[[Sequence[int]], bool] | None = None,
    ) -> None:
        self.config = config
        self.component = component
        self.script: Script = script or (config.script if config and config.script else DEFAULT_SCRIPT)
        self.fail_prefill = fail_prefill
        self.nonfinite: Callable[[Sequence[int]], bool] | None = None
        self.device_error: Exception | None = None
        self.caps: dict[str, Any] = {}
        if component == "mtp":
            self.caps.update({"mtp_draft": True, "default_draft_size": 2})
        self.caches: list[Cache] = []
        self.loaded = False
        self.load_calls: list[dict[str, Any]] = []
        self.warmup_calls: list[dict[str, Any]] = []

    @staticmethod
    def from_config(config: Config, component: str = "text") -> Model:
        assert component in config.model_classes, (
            f"{config.architecture} does not define a '{component}' component model"
        )
        return Model(config, component)

    def load_gen(
        self,
        device: Any = None,
        tp_output_device: Any = None,
        reserve_per_device: list[float] | float | None = None,
        use_per_device: list[float] | float | None = None,
        tensor_p: bool = False,
        progressbar: bool = False,
        max_chunk_size: int = 2048,
        max_output_size: int = 32,
        max_output_factor: int = 1,
        callback: Callable[[int, int], None] | None = None,
        generator: bool = True,
        tp_dev_limits: dict[str, int] | None = None,
        tp_backend: str = "native",
        verbose: bool = False,
        max_batch_size: int = 1,
        tp_options: dict[str, Any] | None = None,
        autosplit_no_forward: bool = False,
        draft_model: Model | None = None,
    ) -> Iterator[tuple[int, int]]:
        """Yields ``(modules_done, modules_total)`` like ``model/model_ls.py:140,318``."""
        self.load_calls.append(
            {
                "use_per_device": use_per_device,
                "tensor_p": tensor_p,
                "tp_backend": tp_backend,
                "max_chunk_size": max_chunk_size,
                "draft_model": draft_model,
                "caches_attached": len(self.caches),
            }
        )
        n = 5
        for i in range(n):
            yield i, n
        self.loaded = True
        for c in self.caches:
            c.initialized = True
        yield n, n

    def load(self, **kwargs: Any) -> None:
        kwargs["generator"] = False
        for _ in self.load_gen(**kwargs):
            pass

    def warmup(
        self,
        cache: Cache | None = None,
        max_chunk_size: int = 2048,
        max_batch_size: int = 8,
        max_q_len: int = 16,
        long_context: bool = True,
        progressbar: bool = False,
        callback: Callable[[int, int], None] | None = None,
        verbose: bool = False,
    ) -> list[str]:
        assert self.loaded, "warmup before load"
        assert cache is None or cache.owner is None, "warmup must run before a Generator owns the cache"
        self.warmup_calls.append({"cache": cache, "max_chunk_size": max_chunk_size})
        # Labels of the passes that raised (model/model.py:252-253); set by tests.
        return list(self.warmup_failures)

    def unload(self) -> None:
        self.loaded = False
        for c in self.caches:
            c.initialized = False


class CacheLayer_fp16:
    """Marker for an FP16 cache layer (``cache/fp16.py``)."""


class CacheLayer_quant:
    """Marker for a quantized cache layer (``cache/quant.py``)."""


class _CacheLayerSize:
    """The sizes of one attention layer's cache tensors: FP16 keys and values
    (``cache/fp16.py:27-30``, ``92-98``), or packed ``k_bits``/``v_bits`` ints per 32 channels
    plus an FP16 scale each (``cache/quant.py:32-42``, ``137-147``)."""

    def __init__(self, tokens: int, kv_heads: int, head_dim: int, bits: tuple[int, int] | None) -> None:
        self.tokens, self.token_dim, self.bits = tokens, kv_heads * head_dim, bits

    def storage_size(self) -> int:
        if self.bits is None:
            return 2 * self.tokens * self.token_dim * 2
        k, v = self.bits
        groups = self.tokens * (self.token_dim // 32)
        return groups * k * 4 + groups * v * 4 + 2 * groups * 2

    def overhead_size(self) -> int:
        return 0 if self.bits is None else 2 * self.token_dim * 2


class Cache:
    """``Cache(model, max_num_tokens, layer_type, max_batch_size, max_history, recurrent_dtype,
    **kwargs)`` (``cache/cache.py:93-185``); ``k_bits``/``v_bits``/``compand_a`` are the
    keyword arguments ``CacheLayer_quant`` takes (``cache/quant.py:15-30``). ``layers`` has
    one entry per attention layer (``cache/cache.py:158-167``), sized from ``config.json``'s
    ``num_hidden_layers``/``num_key_value_heads``/``head_dim``."""

    def __init__(
        self,
        model: Model,
        max_num_tokens: int,
        layer_type: type | None = None,
        max_batch_size: int = 16,
        max_history: int = 0,
        recurrent_dtype: Any = None,
        *,
        k_bits: int | None = None,
        v_bits: int | None = None,
        compand_a: float = 0.0,
    ) -> None:
        assert max_num_tokens % PAGE_SIZE == 0, f"max_num_tokens must be a multiple of {PAGE_SIZE}."
        if layer_type is CacheLayer_quant:
            assert k_bits is not None and v_bits is not None
            assert (2 <= k_bits <= 8) and (2 <= v_bits <= 8), "quantized cache must be from 2 to 8 bits"
        else:
            assert k_bits is None and v_bits is None, "k_bits/v_bits only apply to CacheLayer_quant"
        assert not model.loaded, "Construct the Cache BEFORE calling model.load()"
        self.model = model
        self.max_num_tokens = max_num_tokens
        self.layer_type = layer_type or CacheLayer_fp16
        self.bits = (k_bits, v_bits)
        self.max_batch_size = max_batch_size
        self.max_history = max_history
        self.initialized = False
        self.owner: Generator | None = None
        self.owner_serial = 0
        cfg = model.config.config_dict if model.config is not None else {}
        bits = None if layer_type is not CacheLayer_quant else (int(k_bits or 0), int(v_bits or 0))
        self.layers = {
            (i, 0): _CacheLayerSize(
                max_num_tokens, int(cfg.get("num_key_value_heads", 2)), int(cfg.get("head_dim", 64)), bits
            )
            for i in range(int(cfg.get("num_hidden_layers", 2)))
        }
        model.caches.append(self)


class ComboSampler:
    """Records the ``ComboSampler`` arguments (``generator/sampler/presets.py``, exact 1.6.5
    parameter list). The fake model is greedy whatever they are."""

    def __init__(
        self,
        rep_p: float = 1.0,
        freq_p: float = 0.0,
        pres_p: float = 0.0,
        rep_sustain_range: int = int(10e7),
        rep_decay_range: int = 0,
        dry_multiplier: float = 0.0,
        dry_base: float = 1.75,
        dry_allowed_length: int = 2,
        dry_range: int = 0,
        dry_sequence_breakers: Any = None,
        temperature: float = 1.0,
        min_p: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        temp_last: bool = False,
        adaptive_target: float = 1.0,
        adaptive_decay: float = 0.9,
        logit_bias: dict[int, float] | None = None,
    ) -> None:
        self.settings = {
            "rep_p": rep_p,
            "freq_p": freq_p,
            "pres_p": pres_p,
            "temperature": temperature,
            "min_p": min_p,
            "top_k": top_k,
            "top_p": top_p,
            "logit_bias": logit_bias,
            "rep_sustain_range": rep_sustain_range,
            "rep_decay_range": rep_decay_range,
            "temp_last": temp_last,
            "dry_multiplier": dry_multiplier,
            "dry_base": dry_base,
            "dry_allowed_length": dry_allowed_length,
            "dry_range": dry_range,
            "dry_sequence_breakers": dry_sequence_breakers,
        }


class _Step:
    """One recorded sampler step of a ``CustomSampler`` stack: its class name and arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}{self.args}"


class SS_LogitBias(_Step):
    pass


class SS_RepP(_Step):
    pass


class SS_PresFreqP(_Step):
    pass


class SS_DRY(_Step):
    """``SS_DRY(dry_multiplier, dry_base, dry_allowed_length, dry_range, dry_sequence_breakers,
    tokenizer)``; asserts as 1.6.5 does (``generator/sampler/custom.py:998-1001``)."""

    def __init__(
        self,
        dry_multiplier: float = 0.0,
        dry_base: float = 1.75,
        dry_allowed_length: int = 2,
        dry_range: int = 0,
        dry_sequence_breakers: Any = None,
        tokenizer: Any = None,
    ) -> None:
        assert dry_multiplier >= 0.0, "dry_multiplier must be non-negative"
        assert dry_allowed_length >= 0, "dry_allowed_length must be non-negative"
        super().__init__(dry_multiplier, dry_base, dry_allowed_length, dry_range, dry_sequence_breakers)


class SS_Temperature(_Step):
    pass


class SS_MinP(_Step):
    pass


class SS_TopK(_Step):
    pass


class SS_TopP(_Step):
    pass


class SS_Sample(_Step):
    pass


class SS_XTC(_Step):
    """``SS_XTC(probability, threshold, protected_token_ids=None, tokenizer=None)``; asserts
    both in [0, 1] as 1.6.5 does (``generator/sampler/custom.py:698-699``)."""

    def __init__(
        self, probability: float, threshold: float, protected_token_ids: Any = None, tokenizer: Any = None
    ):
        assert 0.0 <= probability <= 1.0
        assert 0.0 <= threshold <= 1.0
        super().__init__(probability, threshold, protected_token_ids=protected_token_ids, tokenizer=tokenizer)


class CustomSampler:
    """Records a ``CustomSampler(steps)`` stack (``generator/sampler/custom.py:1140-1144``).
    ``settings`` holds what the fake generator reads: the ``SS_LogitBias`` step's biases."""

    def __init__(self, steps: list[_Step]) -> None:
        self.steps = steps
        bias = next((s.args[0] for s in steps if isinstance(s, SS_LogitBias)), None)
        self.settings: dict[str, Any] = {"logit_bias": bias or None}


# ---------------------------------------------------------------- paging


_unique_hashes = 0


def _random_hash() -> bytes:
    """``_randomhash`` (``pagetable.py:30-34``): a process-wide counter, 16 bytes big-endian, so
    its first 8 bytes are zero."""
    global _unique_hashes
    _unique_hashes += 1
    return _unique_hashes.to_bytes(16, "big")


def _is_content_hash(h: bytes) -> bool:
    """``is_content_hash`` (``pagetable.py:39-42``)."""
    return h[:8] != bytes(8)


class _Page:
    """One cache page (``pagetable.py:45-81``). ``*_revert`` and ``can_revert`` keep what the
    page held before a job reserved it for new tokens, so that a reservation the job never
    writes gives the page back unchanged (``pagetable.py:112-127``). ``sequence`` is the
    ``(1, n)`` tensor of its tokens (1.6.5's is ``(1, PAGE_SIZE)``, valid up to
    ``kv_position``, ``pagetable.py:390``)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.phash: bytes = _random_hash()
        self.prev_hash: Any = None
        self.tokens: list[int] = []
        self.kv_position = 0
        self.ref_count = 0
        self.access = 0
        self.can_revert = False
        self.phash_revert: Any = self.phash
        self.prev_hash_revert: Any = None
        self.tokens_revert: list[int] = []
        self.kv_position_revert = 0
        self.access_revert = 0

    @property
    def content_hashed(self) -> bool:
        return _is_content_hash(self.phash)

    @property
    def sequence(self) -> FakeTensor:
        return FakeTensor(self.tokens)

    def backup(self) -> None:
        """``CachePage.backup`` (``pagetable.py:112-118``)."""
        self.phash_revert, self.prev_hash_revert = self.phash, self.prev_hash
        self.tokens_revert, self.kv_position_revert = self.tokens, self.kv_position
        self.access_revert = self.access
        self.can_revert = True


def _chain_hash(prev: bytes | None, tokens: Sequence[int]) -> bytes:
    """``_tensor_blake2b_checksum`` (``pagetable.py:23-28``): blake2b, 16 bytes, of the previous
    page's hash and the page's ``torch.long`` tokens as ``numpy().tobytes()`` (int64,
    little-endian on the x86 and ARM hosts CUDA runs on)."""
    h = hashlib.blake2b(digest_size=16)
    if prev is not None:
        h.update(prev)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


class _PageTable:
    """Pages of ``PAGE_SIZE`` tokens; ``by_hash`` holds content-hashed pages whether
    referenced or not (``pagetable.py:553-680``).

    Reserved pages keep a backup: a page taken for new tokens (``add_ref_unique``,
    ``pagetable.py:153-164``) is restored to its previous hash, tokens and position when
    its last job releases it without having written it (``sub_ref``,
    ``pagetable.py:166-177``). Every prefill or decode write clears ``can_revert``
    (``job.py:1435,1497,1662``, ``generator.py:1678``, ``job.py:697``). A page missing
    by hash is cleared with no backup (``add_ref_clear``, ``pagetable.py:140-150``)."""

    def __init__(self, max_pages: int) -> None:
        self.pages = [_Page(i) for i in range(max_pages)]
        self.by_hash: dict[Any, _Page] = {}
        self.serial = 0

    @property
    def max_pages(self) -> int:
        return len(self.pages)

    @property
    def all_pages(self) -> list[_Page]:
        """``PageTable.all_pages`` (``pagetable.py:380-399``, ``reset_page_table``)."""
        return self.pages

    def num_unreferenced_pages(self) -> int:
        return sum(1 for p in self.pages if p.ref_count == 0)

    def _tick(self) -> int:
        self.serial += 1
        return self.serial

    def build_eviction_order(self, protected: set[Any]) -> deque[_Page]:
        """``PageTable.build_eviction_order`` (``pagetable.py:411-520``, the default "tree"
        policy): the unreferenced pages, least valuable first. Empty pages oldest first; then
        orphaned trees (a chain whose first page's ``prev_hash`` no longer names a page) and
        then rooted trees, each tree least recently used root first and eaten leaf-first, the
        oldest leaf first (a page in use or in ``protected`` blocks its ancestors); whatever
        that walk could not reach last, ``protected`` pages dead last."""
        order: list[_Page] = []
        emitted: set[int] = set()
        empty = [
            p for p in self.pages if p.ref_count == 0 and p.kv_position == 0 and p.phash not in protected
        ]
        for p in sorted(empty, key=lambda p: p.access):
            order.append(p)
            emitted.add(p.index)
        by_hash = {p.phash: p for p in self.pages}
        children: dict[int, list[_Page]] = {p.index: [] for p in self.pages}
        parent_of: dict[int, _Page] = {}
        roots: list[_Page] = []
        orphans: list[_Page] = []
        for p in self.pages:
            if p.prev_hash is None:
                roots.append(p)
                continue
            parent = by_hash.get(p.prev_hash)
            if parent is None or parent is p:
                orphans.append(p)
            else:
                children[parent.index].append(p)
                parent_of[p.index] = parent

        def prune(root: _Page) -> None:
            remaining: dict[int, int] = {}
            heap: list[tuple[int, int, _Page]] = []
            stack = [root]
            while stack:
                p = stack.pop()
                remaining[p.index] = len(children[p.index])
                if not children[p.index]:
                    heapq.heappush(heap, (p.access, p.index, p))
                stack.extend(children[p.index])
            while heap:
                _, _, p = heapq.heappop(heap)
                if p.index not in emitted:
                    if p.ref_count > 0 or p.phash in protected:
                        continue
                    order.append(p)
                    emitted.add(p.index)
                parent = parent_of.get(p.index)
                if parent is not None:
                    remaining[parent.index] -= 1
                    if remaining[parent.index] == 0:
                        heapq.heappush(heap, (parent.access, parent.index, parent))

        for root in sorted(orphans, key=lambda p: p.access) + sorted(roots, key=lambda p: p.access):
            prune(root)
        rest = [p for p in self.pages if p.ref_count == 0 and p.index not in emitted]
        order += sorted(rest, key=lambda p: (p.phash in protected, p.access))
        return deque(order)

    def set_hash(self, page: _Page, h: Any) -> None:
        if self.by_hash.get(page.phash) is page:
            del self.by_hash[page.phash]
        page.phash = h
        if _is_content_hash(h):
            assert self.by_hash.get(h) in (None, page), "two pages with one content hash"
            self.by_hash[h] = page

    def make_unique(self, page: _Page) -> None:
        self.set_hash(page, _random_hash())

    def clear(self, page: _Page) -> None:
        """``CachePage.clear`` (``pagetable.py:178-188``): an unreferenced page loses its content."""
        assert page.ref_count == 0
        self.make_unique(page)
        page.prev_hash, page.kv_position, page.tokens, page.can_revert = None, 0, [], False

    def allocate(self, page_hashes: list[Any], new_unique_pages: int) -> tuple[list[_Page], int]:
        """``PageTable.allocate_pages`` (``pagetable.py:553-680``) without the CPU tier. The
        eviction order is built once, at the first page not found by hash, and pages claimed
        by hash since are skipped (``next_evictable``, ``pagetable.py:577-587``); ``protected``
        is the job's own prompt hashes (``job.py:1705-1708``)."""
        protected = set(page_hashes)
        available: deque[_Page] | None = None

        def next_evictable() -> _Page:
            nonlocal available
            if available is None:
                available = self.build_eviction_order(protected)
            else:
                while available[0].ref_count:
                    available.popleft()
            return available.popleft()

        out: list[_Page] = []
        for h in page_hashes:
            tick = self._tick()
            page = self.by_hash.get(h)
            if page is not None:
                # add_ref (pagetable.py:130-137)
                page.access = max(tick, page.access)
            else:
                # add_ref_clear (pagetable.py:140-150)
                page = next_evictable()
                self.set_hash(page, h)
                page.tokens, page.kv_position, page.prev_hash = [], 0, None
                page.access = tick
            page.ref_count += 1
            page.can_revert = False
            out.append(page)
        for _ in range(new_unique_pages):
            tick = self._tick()
            # add_ref_unique (pagetable.py:153-164)
            page = next_evictable()
            page.backup()
            self.make_unique(page)
            page.tokens, page.kv_position, page.prev_hash = [], 0, None
            page.ref_count += 1
            page.access = tick
            # Link the first fresh page to a complete cached prefix (pagetable.py:640-646).
            if out and out[-1].kv_position == PAGE_SIZE:
                page.prev_hash = out[-1].phash
            out.append(page)
        cached = 0
        for page in out:
            if page.kv_position != PAGE_SIZE:
                break
            cached += 1
        return out, cached

    def deallocate(self, pages: list[_Page]) -> None:
        """``sub_ref`` per page (``pagetable.py:166-177``): the last release of a reserved page
        nobody wrote restores its previous content, under a fresh hash if another page has
        taken that content hash meanwhile."""
        for p in pages:
            p.ref_count -= 1
            if p.ref_count or not p.can_revert:
                continue
            old = p.phash_revert
            p.prev_hash, p.tokens = p.prev_hash_revert, p.tokens_revert
            p.kv_position, p.access = p.kv_position_revert, p.access_revert
            p.can_revert = False
            if any(q.phash == old for q in self.pages if q is not p):
                self.make_unique(p)
                p.prev_hash = None
            else:
                self.set_hash(p, old)


def _partial_strings_match(text: str, strings: Sequence[str]) -> int:
    """``exllamav3_ext/generator/strings.cpp:partial_strings_match``: index of the earliest full
    match, ``-2`` if a string runs off the end of ``text`` before any full match, else ``-1``."""
    none = len(text) + 1
    best_full = best_partial = none
    for s in strings:
        if not s:
            continue
        limit = min(best_full, best_partial)
        for a0 in range(min(len(text), limit)):
            k = 0
            while a0 + k < len(text) and k < len(s) and text[a0 + k] == s[k]:
                k += 1
            if k == len(s):
                best_full = a0
                break
            if a0 + k == len(text):
                best_partial = a0
                break
    if best_partial < best_full:
        return -2
    return best_full if best_full < none else -1


# ---------------------------------------------------------------- filters

# Filter journal entry types (generator/filter/filter.py:8-11).
FJ_PASS, FJ_TRIGGER, FJ_ACCEPT, FJ_COMPLETE = 0, 1, 2, 3


class Filter:
    """``exllamav3.Filter`` (``generator/filter/filter.py``), its ``feed``/``attach`` as in
    1.6.5; masks are numpy arrays where 1.6.5 has CPU torch tensors."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        trigger_token: int | None,
        prefix_str: str | None,
        eos_after_completed: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.trigger_token = trigger_token
        self.prefix_str = prefix_str
        self.eos_after_completed = eos_after_completed
        self.job: Job | None = None
        self.generator: Generator | None = None
        self.vocab_size: int | None = None
        self.is_active = trigger_token is None
        self._journal: list[tuple[int, int]] = []

    def feed(self, token: int) -> bool:
        """``Filter.feed`` (``filter.py:50-70``): advance on an emitted token; True when the
        filter completed on it and ``eos_after_completed`` is set."""
        if not self.is_active:
            if token == self.trigger_token:
                self.is_active = True
                self.reset()
                self._journal.append((FJ_TRIGGER, token))
            else:
                self._journal.append((FJ_PASS, token))
            return False
        self.accept_token(token)
        if self.is_completed():
            self.is_active = False
            self._journal.append((FJ_COMPLETE, token))
            return self.eos_after_completed
        self._journal.append((FJ_ACCEPT, token))
        return False

    def reset(self) -> None:
        raise NotImplementedError

    def accept_token(self, token: int) -> None:
        raise NotImplementedError

    def get_next_logit_mask(self) -> Any:
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError

    def use_background_worker(self) -> bool:
        return True

    def attach(self, job: Job) -> None:
        """``Filter.attach`` (``filter.py:155-162``): runs when the job starts (``Job.activate``)."""
        self.job = job
        self.generator = job.generator
        assert job.generator is not None
        self.vocab_size = job.generator.padded_vocab_size
        self._journal.clear()


_LL_TOKENIZERS: dict[int, Any] = {}


def create_ll_tokenizer(tokenizer: Tokenizer) -> Any:
    """``generator/filter/llguidance.py:17-29``: an ``LLTokenizer`` from the serialized HF
    tokenizer, EOS from ``config.eos_token_id_list`` or else ``eos_token_id``; cached per
    tokenizer object (an ``lru_cache`` there)."""
    key = id(tokenizer)
    if key not in _LL_TOKENIZERS:
        from llguidance import LLTokenizer

        eos: Any = None
        cfg = tokenizer.config
        if getattr(cfg, "eos_token_id_list", None):
            eos = list(cfg.eos_token_id_list)  # type: ignore[union-attr]
        elif tokenizer.eos_token_id is not None:
            eos = tokenizer.eos_token_id
        _LL_TOKENIZERS[key] = LLTokenizer(tokenizer.tokenizer.to_str(), eos_token=eos)
    return _LL_TOKENIZERS[key]


class LLGuidanceFilter(Filter):
    """``exllamav3.LLGuidanceFilter`` (``generator/filter/llguidance.py:32-163``), line for line
    over the real ``llguidance``: exactly one grammar source (``85-86``), compiled and
    validated in the constructor, ``ValueError("Invalid grammar: ...")`` when it does not
    (``92-95``); every matcher call checked by ``_check_error``, which raises ``RuntimeError``
    (``110-112``); masks are packed int32 bitmasks, bit set = allowed (``146-153``);
    ``is_completed`` is the matcher's ``is_stopped`` (``155-156``)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        trigger_token: int | None = None,
        prefix_str: str | None = None,
        eos_after_completed: bool = False,
        json_schema: dict[str, Any] | str | None = None,
        regex: str | None = None,
        lark_grammar: str | None = None,
        gbnf_grammar: str | None = None,
        llg_grammar: str | None = None,
        consume_prefix: bool = False,
    ) -> None:
        import numpy as np
        from llguidance import LLMatcher, grammar_from

        super().__init__(tokenizer, trigger_token, prefix_str, eos_after_completed)
        sources = [
            ("json_schema", json_schema),
            ("regex", regex),
            ("lark", lark_grammar),
            ("gbnf", gbnf_grammar),
            ("llguidance", llg_grammar),
        ]
        given = [(f, g) for f, g in sources if g is not None]
        assert len(given) == 1, (
            "Specify exactly one of json_schema, regex, lark_grammar, gbnf_grammar, llg_grammar"
        )
        g_format, g_text = given[0]
        if isinstance(g_text, dict):
            g_text = json.dumps(g_text)
        self._ll_tokenizer = create_ll_tokenizer(tokenizer)
        self._grammar = grammar_from(g_format, g_text)  # type: ignore[arg-type]
        err = LLMatcher.validate_grammar(self._grammar, self._ll_tokenizer)
        if err:
            raise ValueError(f"Invalid grammar: {err}")
        self._matcher = LLMatcher(self._ll_tokenizer, self._grammar)
        self._consume_prefix = consume_prefix
        self._consumed = 0
        self._bitmask = np.empty(((self._ll_tokenizer.vocab_size + 31) // 32,), dtype=np.int32)
        self._bitmask_torch = self._bitmask.reshape(1, -1)
        self._start()

    def _start(self) -> None:
        if self._consume_prefix and self.prefix_str:
            tokens = self._ll_tokenizer.tokenize_str(self.prefix_str)
            self._matcher.consume_tokens(tokens)
        self._check_error()

    def _check_error(self) -> None:
        if self._matcher.is_error():
            raise RuntimeError(f"llguidance matcher error: {self._matcher.get_error()}")

    def reset(self) -> None:
        from llguidance import LLMatcher

        if self._matcher.is_error():
            self._matcher = LLMatcher(self._ll_tokenizer, self._grammar)
        else:
            self._matcher.reset()
        self._consumed = 0
        self._start()

    def accept_token(self, token: int) -> None:
        if self._matcher.is_stopped():
            return
        if self._matcher.consume_token(token):
            self._consumed += 1
        self._check_error()

    def get_next_logit_mask(self) -> Any:
        bm = self._bitmask
        self._matcher.unsafe_compute_mask_ptr(bm.ctypes.data, bm.size * bm.itemsize)
        self._check_error()
        return self._bitmask_torch

    def is_completed(self) -> bool:
        return bool(self._matcher.is_stopped())


def _allowed_by(mask: Any, vocab: int) -> set[int]:
    """Token ids whose bit is set in a packed int32 mask of shape ``(1, words)``; tokens past
    the mask's width count as masked out (``filter.py:132-140``)."""
    import numpy as np

    bits = np.unpackbits(np.ascontiguousarray(mask).reshape(-1).view(np.uint8), bitorder="little")
    return {int(i) for i in np.flatnonzero(bits[:vocab])}


class _SuffixAutomaton:
    """The n-gram drafter's suffix automaton (``exllamav3_ext/sam.cpp``, ``BC_SAM``), built
    token by token over a job's sequence. ``accept(seq)`` adds the tokens it has not seen and
    returns ``(begin, end)`` (end exclusive) of the earliest earlier occurrence of the longest
    suffix of ``seq`` that occurred before, found by a match that follows the sequence as it
    grows (``advance_match``: a state's first end position, ``min_end``), or ``(-1, -1)``."""

    def __init__(self) -> None:
        self.link = [-1]
        self.max_len = [0]
        self.first_end = [2**31 - 1]
        self.edges: list[dict[int, int]] = [{}]
        self.last = 0
        self.match_state = 0
        self.match_len = 0
        self.pos = 0

    def _new_state(self, max_len: int, link: int, first_end: int, edges: dict[int, int]) -> int:
        self.link.append(link)
        self.max_len.append(max_len)
        self.first_end.append(first_end)
        self.edges.append(edges)
        return len(self.link) - 1

    def _advance_match(self, token: int) -> tuple[int, int]:
        state, length = self.match_state, self.match_len
        while state != 0 and token not in self.edges[state]:
            state = self.link[state]
            length = min(length, self.max_len[state])
        if token in self.edges[state]:
            state, length = self.edges[state][token], length + 1
        else:
            state, length = 0, 0
        self.match_state, self.match_len = state, length
        return state, length

    def _extend(self, token: int) -> None:
        cur = self._new_state(self.max_len[self.last] + 1, 0, self.pos, {})
        p = self.last
        while p != -1 and token not in self.edges[p]:
            self.edges[p][token] = cur
            p = self.link[p]
        if p != -1:
            q = self.edges[p][token]
            if self.max_len[p] + 1 == self.max_len[q]:
                self.link[cur] = q
            else:
                clone = self._new_state(
                    self.max_len[p] + 1, self.link[q], self.first_end[q], dict(self.edges[q])
                )
                while p != -1 and self.edges[p].get(token) == q:
                    self.edges[p][token] = clone
                    p = self.link[p]
                self.link[q] = clone
                self.link[cur] = clone
        self.last = cur
        self.pos += 1

    def accept(self, seq: Sequence[int]) -> tuple[int, int]:
        if len(seq) < self.pos:
            self.__init__()  # type: ignore[misc]  # a rewound sequence: rebuilt (sam.cpp accept_tensor)
        if len(seq) == self.pos:
            return -1, -1
        state = length = 0
        for token in seq[self.pos :]:
            state, length = self._advance_match(token)
            self._extend(token)
        if length == 0:
            return -1, -1
        end = self.first_end[state] + 1
        return end - length, end


# ---------------------------------------------------------------- jobs


class Job:
    """``exllamav3.Job`` with the exact 1.6.5 parameter list (``generator/job.py:54-75``)."""

    def __init__(
        self,
        input_ids: Any,
        max_new_tokens: int | None = None,
        min_new_tokens: int = 0,
        max_skips: int | None = 4,
        sampler: Any = None,
        seed: int | None = None,
        stop_conditions: list[int | str] | tuple[int | str, ...] | set[int | str] | None = None,
        decode_special_tokens: bool = False,
        return_top_tokens: int = 0,
        return_logits: bool = False,
        return_probs: bool = False,
        filters: list[Any] | None = None,
        token_healing: bool = False,
        identifier: object | None = None,
        banned_strings: list[str] | None = None,
        embeddings: list[Any] | None = None,
        max_rq_tokens: int | None = None,
        stop_on_loop: tuple[int, int] | None = None,
        rq_state: dict[str, Any] | None = None,
    ) -> None:
        if token_healing or embeddings or stop_on_loop or return_logits:
            raise NotImplementedError("feature not modelled by the fake")
        ids = _ids_of(input_ids)
        assert len(ids) > 0, "Input IDs cannot be empty."
        assert max_new_tokens is None or max_new_tokens >= 1, (
            "max_new_tokens must be >= 1, or None for no limit"
        )
        rq = rq_state or {}
        self.is_requeued = rq_state is not None
        self.rq_new_tokens: int = rq.get("rq_new_tokens", 0)
        self.generator: Generator | None = None
        self.serial_number: int | None = None
        self.identifier = identifier
        self.max_skips = max_skips
        self.skips = 0
        self.sampler = sampler if sampler is not None else ComboSampler(min_p=0.08, temperature=0.8)
        self.seed = seed
        self.input_ids = ids
        self.sequence_ids = list(ids)
        self.client_prompt: list[int] = rq.get("client_prompt", list(ids))
        self.sam: _SuffixAutomaton | None = rq.get("sam")
        self.kv_position = 0
        self.page_hashes: list[Any] = []
        self.max_cached_pages: int | None = None
        self.new_unique_pages = 0
        self.allocated_pages: list[_Page] = []
        self.prefill_complete = False
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = min_new_tokens
        self.new_tokens = 0
        self.orig_max_rq_tokens = max_rq_tokens
        self.max_rq_tokens: int = max_rq_tokens or 0
        self.rq_margin = 0
        self.rq_headroom = 0
        self.decode_special_tokens = decode_special_tokens
        self.return_top_tokens = return_top_tokens
        self.return_probs = return_probs
        # job.py:289; a re-queued job keeps the same filter objects and their state (job.py:1250)
        self.filters: list[Filter] = list(filters) if filters is not None else []
        self.logit_mask: set[int] | None = None
        # One entry per active filter, the position's mask (job.py:411-434): a future from the
        # generator's filter pool, or None, and the mask computed inline, or None.
        self.filter_futures: list[Future[Any] | None] = []
        self.logit_masks: list[Any] = []
        self.stop_tokens: set[int] = set(rq.get("stop_tokens", set()))
        self.stop_strings: set[str] = set(rq.get("stop_strings", set()))
        if stop_conditions is not None:
            for t in [stop_conditions] if isinstance(stop_conditions, int | str) else stop_conditions:
                if isinstance(t, int):
                    self.stop_tokens.add(t)
                elif isinstance(t, str):
                    self.stop_strings.add(t)
                else:
                    raise ValueError("Unsupported type in stop_conditions")
        self.stop_string_max_length = max([0] + [len(s) for s in self.stop_strings])
        # job.py:615-623: lowercased; matched against the lowercased held text.
        self.banned_strings: list[str] = [s.lower() for s in banned_strings or []]
        self.checkpoint: dict[str, Any] | None = None
        self.held_text: str = rq.get("held_text", "")
        self.held_tokens: list[int] = list(rq.get("held_tokens", []))
        self.held_probs: list[float] = list(rq.get("held_probs", []))
        self.held_k_tokens: list[list[int]] = list(rq.get("held_k_tokens", []))
        self.held_k_probs: list[list[float]] = list(rq.get("held_k_probs", []))
        self.full_completion: str = rq.get("full_completion", "")
        self.time_enqueue: float | None = None
        self.time_first_prefill: float | None = None
        self.time_first_token: float | None = None
        self.time_last_token: float | None = None
        self.time_enqueued: float = rq.get("time_enqueued", 0.0)
        self.time_prefill: float = rq.get("time_prefill", 0.0)
        self.time_generate: float = rq.get("time_generate", 0.0)
        self.accepted_draft_tokens: int = rq.get("accepted_draft_tokens", 0)
        self.rejected_draft_tokens: int = rq.get("rejected_draft_tokens", 0)
        self.rq_prompt_tokens: int | None = rq.get("prompt_tokens")
        self.rq_cached: tuple[int, int] | None = rq.get("cached")
        self.cached_pages = 0
        self.cached_tokens = 0
        self.is_finished = False

    def __repr__(self) -> str:
        return f"Generator job #{self.serial_number}"

    def _cached(self) -> tuple[int, int]:
        return self.cached_pages, self.cached_pages * PAGE_SIZE + self.cached_tokens

    # -- queueing

    def prepare_for_queue(self, generator: Generator, serial_number: int, rq: bool = False) -> None:
        """``job.py:1264-1378``."""
        self.serial_number = serial_number
        self.generator = generator
        self.skips = 0
        room = generator.max_total_tokens - len(self.input_ids) - 1 - generator.max_draft_tokens
        if self.max_new_tokens is None:
            self.max_new_tokens = max(1, room)
        elif room >= 1:
            self.max_new_tokens = min(self.max_new_tokens, room)
        if self.orig_max_rq_tokens is not None:
            x = len(self.input_ids)
            y = (x - 1 + self.orig_max_rq_tokens + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
            y = min(y, generator.max_total_tokens - generator.max_draft_tokens)
            self.max_rq_tokens = max(1, y - x)
            self.rq_margin = 0
            self.rq_headroom = generator.max_draft_tokens
        else:
            self.max_rq_tokens = self.max_new_tokens + 1 + generator.max_draft_tokens
            self.rq_margin = generator.max_draft_tokens
            self.rq_headroom = 0
        # Sequence.prepare (pagetable.py:240-259)
        seq = self.sequence_ids
        max_len = len(seq) + self.max_rq_tokens + self.rq_headroom
        context_pages = (len(seq) - 1) // PAGE_SIZE
        total = (max_len + PAGE_SIZE - 1) // PAGE_SIZE
        h = None
        self.page_hashes = []
        for i in range(context_pages):
            h = _chain_hash(h, seq[i * PAGE_SIZE : (i + 1) * PAGE_SIZE])
            self.page_hashes.append(h)
        self.new_unique_pages = total - context_pages
        # MTP: the page holding the last prompt token is never reused, so that prefill runs at
        # least one real token through the target model (job.py:1329-1333).
        self.max_cached_pages = max(0, (len(seq) - 2) // PAGE_SIZE) if generator.mtp_draft else None
        total_pages = len(set(self._reusable_hashes())) + self._fresh_pages()
        max_pages = generator.pagetable.max_pages
        assert total_pages <= max_pages, (
            f"Job requires {total_pages} pages (only {max_pages} available) and cannot "
            + f"be enqueued. Total cache allocated is {max_pages} * {PAGE_SIZE} = "
            + f"{generator.max_total_tokens} tokens"
        )
        if not rq:
            self.held_text = ""
            self.held_tokens = []
            self.held_probs, self.held_k_tokens, self.held_k_probs = [], [], []  # job.py:1351-1355
            self.full_completion = ""
        self.time_enqueue = time.time()

    def _reusable_hashes(self) -> list[Any]:
        """Prompt page hashes looked up at allocation (``pagetable.py:291-296``)."""
        return (
            self.page_hashes if self.max_cached_pages is None else self.page_hashes[: self.max_cached_pages]
        )

    def _fresh_pages(self) -> int:
        """Pages taken without a lookup: new tokens plus prompt pages MTP leaves out."""
        return self.new_unique_pages + len(self.page_hashes) - len(self._reusable_hashes())

    def current_new_pages_required(self) -> int:
        """``job.py:1380-1388``."""
        pt = self.pagetable
        referenced = {p.phash for p in pt.pages if p.ref_count > 0}
        return sum(1 for h in set(self._reusable_hashes()) if h not in referenced) + self._fresh_pages()

    @property
    def pagetable(self) -> _PageTable:
        assert self.generator is not None
        return self.generator.pagetable

    def activate(self) -> None:
        """``job.py:1764-1773``: filters are attached and reset when the job starts, not when a
        re-queued segment starts again (their state carries over)."""
        if not self.is_requeued:
            for f in self.filters:
                f.attach(self)
                f.reset()
                f.is_active = f.trigger_token is None

    def prepare_logit_mask(self) -> None:
        """``job.py:411-486`` for the masks the fake models: the active filters' bitmasks ANDed,
        stop tokens blocked before ``min_new_tokens`` (``job.py:461-462``). ``logit_mask`` is the
        set of allowed ids, ``None`` when nothing is masked. The masks were started by
        ``Generator._launch_filters``; a background filter's is waited for here, on the
        engine thread, which re-raises whatever ``get_next_logit_mask`` raised on the pool
        (``job.py:423-434``)."""
        gen = self.generator
        assert gen is not None
        allowed: set[int] | None = None
        i = 0
        for f in self.filters:
            if not f.is_active:
                continue
            future = self.filter_futures[i]
            mask = future.result() if future is not None else self.logit_masks[i]
            i += 1
            bits = _allowed_by(mask, gen.padded_vocab_size)
            allowed = bits if allowed is None else allowed & bits
        self.filter_futures.clear()
        self.logit_masks.clear()
        if self.checkpoint is not None and self.checkpoint["offset"] == 0:
            # job.py:457-460: the tokens already tried where a banned string began.
            if allowed is None:
                allowed = set(range(gen.padded_vocab_size))
            allowed -= set(self.checkpoint["explored_tokens"])
        if self.new_tokens < self.min_new_tokens and self.stop_tokens:
            if allowed is None:
                allowed = set(range(gen.padded_vocab_size))
            allowed -= self.stop_tokens
        self.logit_mask = allowed

    def allocate_pages(self) -> None:
        self.allocated_pages, cached = self.pagetable.allocate(self._reusable_hashes(), self._fresh_pages())
        self.kv_position = cached * PAGE_SIZE
        self.cached_pages += cached

    def deallocate_pages(self) -> None:
        if self.allocated_pages:
            self.pagetable.deallocate(self.allocated_pages)
            self.allocated_pages = []

    def is_prefill_done(self) -> bool:
        return self.kv_position == len(self.sequence_ids) - 1

    def _hash_completed_page(self, index: int, h: Any) -> _Page:
        """``Job.hash_completed_page`` (``job.py:652-697``): a referenced page already holding
        ``h`` replaces this job's page; an unreferenced one is cleared. Returns the page now
        at ``index``."""
        pt = self.pagetable
        page = self.allocated_pages[index]
        other = pt.by_hash.get(h)
        if other is not None and other is not page:
            if other.ref_count > 0:
                access = page.access
                pt.deallocate([page])
                other.ref_count += 1
                other.access = max(access, other.access)
                other.can_revert = False
                self.allocated_pages[index] = other
                return other
            pt.clear(other)
        pt.set_hash(page, h)
        page.can_revert = False
        return page

    # -- prefill (job.py:1391-1693)

    def prefill(self, results: list[dict[str, Any]], chunk_size: int | None = None) -> None:
        gen = self.generator
        assert gen is not None
        if self.time_first_prefill is None:
            self.time_first_prefill = time.time()
        progress = 0
        seq = self.sequence_ids
        pages = self.allocated_pages
        if not self.prefill_complete:
            start = self.kv_position
            end = min((self.kv_position + gen.max_chunk_size) // PAGE_SIZE * PAGE_SIZE, len(seq) - 1)
            p0, p1 = start // PAGE_SIZE, (end + PAGE_SIZE - 1) // PAGE_SIZE
            for i in range(p0, p1):
                if pages[i].kv_position != PAGE_SIZE:
                    break
                start = self.kv_position = (i + 1) * PAGE_SIZE
                self.cached_pages += 1
                pages[i].can_revert = False
            for i in range(start // PAGE_SIZE, p1):
                if pages[i].kv_position == PAGE_SIZE:
                    end = i * PAGE_SIZE
                    break
            if chunk_size is not None:
                end = min(end, (start + chunk_size) // PAGE_SIZE * PAGE_SIZE)
            if end > start:
                p0 = start // PAGE_SIZE
                if start == p0 * PAGE_SIZE:
                    prev_hash = None if p0 == 0 else pages[p0 - 1].phash
                    chunk = seq[start:end]
                    best, best_page = 0, None
                    for page in gen.pagetable.pages:
                        if page.prev_hash != prev_hash or page is pages[p0]:
                            continue
                        m = 0
                        while m < min(page.kv_position, len(chunk)) and page.tokens[m] == chunk[m]:
                            m += 1
                        if m > best:
                            best, best_page = m, page
                    # MTP keeps one real prompt token for the target model (job.py:1476-1479).
                    if gen.mtp_draft and end == len(seq) - 1:
                        best = min(best, len(chunk) - 1)
                    if best_page is not None and best > 1:
                        target = pages[p0]
                        target.tokens = list(chunk[:best])
                        target.prev_hash = best_page.prev_hash
                        target.kv_position = best
                        target.can_revert = False
                        start += best
                        self.kv_position += best
                        self.cached_tokens += best
                        progress += best
                if end > start:
                    model = gen.model
                    if model.fail_prefill is not None and model.fail_prefill(self.client_prompt):
                        raise RuntimeError(f"prefill failed for job {self.serial_number}")
                    self.kv_position = end
                    # Pages p0..end // PAGE_SIZE, the one after an aligned end included, reset to
                    # position 0 (job.py:1463,1646-1662); hashing follows in a second pass, so a
                    # page rebuilt in this chunk links to its predecessor's old hash (job.py:1664-1672).
                    touched = range(p0, min(end // PAGE_SIZE + 1, len(pages)))
                    for i in touched:
                        page = pages[i]
                        page.kv_position = min(max(end - i * PAGE_SIZE, 0), PAGE_SIZE)
                        page.tokens = list(seq[i * PAGE_SIZE : i * PAGE_SIZE + page.kv_position])
                        page.prev_hash = None if i == 0 else pages[i - 1].phash
                        page.can_revert = False
                    for i in touched:
                        page = pages[i]
                        if (
                            page.kv_position == PAGE_SIZE
                            and i < len(self.page_hashes)
                            and page.phash != self.page_hashes[i]
                        ):
                            self._hash_completed_page(i, self.page_hashes[i])
                    progress += end - start
                    if self.kv_position >= len(seq) - 1:
                        self.prefill_complete = True
        if progress:
            r: dict[str, Any] = {
                "job": self,
                "stage": "prefill",
                "eos": False,
                "curr_progress": self.kv_position,
                "max_progress": len(seq) - 1,
                "serial": self.serial_number,
            }
            if self.identifier is not None:
                r["identifier"] = self.identifier
            results.append(r)

    # -- decoding

    def ngram_draft(self, length: int, match_min: int) -> list[int]:
        """``Job.get_ngram_draft`` (``job.py:1899-1920``, no corpus): the tokens after the
        earlier occurrence of the longest suffix the job's suffix automaton matches, when that
        suffix has ``match_min`` tokens or more."""
        if self.sam is None:
            self.sam = _SuffixAutomaton()
        seq = self.sequence_ids
        begin, end = self.sam.accept(seq)
        return seq[end : end + length] if end - begin >= match_min else []

    def receive_sample(
        self,
        token: int,
        results: list[dict[str, Any]],
        prob: float | None = None,
        k_tokens: list[int] | None = None,
        k_probs: list[float] | None = None,
    ) -> tuple[bool, bool]:
        """``job.py:781-1191`` without healing or loop detection; ``prob`` and
        ``k_tokens``/``k_probs`` are what ``receive_logits`` returned (``job.py:764-778``).
        Returns ``(eos, requeue)``."""
        gen = self.generator
        assert gen is not None
        # Filters are fed first (job.py:807-811).
        filter_eos_condition = False
        for f in self.filters:
            filter_eos_condition |= f.feed(token)
        self.new_tokens += 1
        requeue_now = self.new_tokens > self.max_rq_tokens - self.rq_margin
        # The forward pass wrote the K/V of the token it was fed (the last one of the sequence,
        # generator.py:1671-1679); the sampled token is fed by the next pass.
        page_before = self.kv_position // PAGE_SIZE
        page = self.allocated_pages[page_before]
        page.tokens.append(self.sequence_ids[self.kv_position])
        page.kv_position += 1
        page.can_revert = False
        self.sequence_ids.append(token)
        self.kv_position += 1
        if self.kv_position // PAGE_SIZE > page_before:
            page = self._hash_completed_page(page_before, _chain_hash(page.prev_hash, page.tokens))
            if page_before + 1 < len(self.allocated_pages):
                nxt = self.allocated_pages[page_before + 1]
                nxt.prev_hash = page.phash
                nxt.can_revert = False

        def emit(
            emit_eos: bool = False,
            eos_reason: str | None = None,
            emit_held: bool = False,
            stop_token: int | None = None,
            stop_string: str | None = None,
            rem_held_text: str | None = None,
        ) -> tuple[bool, bool]:
            nonlocal requeue_now
            if emit_eos:
                requeue_now = False
            r: dict[str, Any] = {"job": self, "stage": "streaming", "eos": emit_eos}
            r["serial"] = self.serial_number
            if eos_reason is not None:
                r["eos_reason"] = eos_reason
                if eos_reason == "stop_token":
                    assert stop_token is not None
                    r["eos_triggering_token_id"] = stop_token
                    r["eos_triggering_token_str"] = _piece(stop_token)
                if eos_reason == "stop_string":
                    r["eos_triggering_string"] = stop_string
            if requeue_now:
                r["requeue"] = True
                if self.checkpoint is not None:
                    emit_held = True  # job.py:882-884: no rewinding past a requeue
            if emit_held:
                if emit_eos and "\ufffd" in self.held_text and self.held_tokens:
                    self.held_text = gen.tokenizer.decode(
                        FakeTensor(self.held_tokens), decode_special_tokens=self.decode_special_tokens
                    )[0]
                if self.held_text != "":
                    self.full_completion += self.held_text
                    r["text"] = self.held_text
                    self.held_text = ""
                if self.held_tokens:
                    r["token_ids"] = FakeTensor(self.held_tokens)
                    self.held_tokens = []
                # job.py:902-907
                if self.held_probs:
                    r["token_probs"] = FakeArray([self.held_probs])
                    self.held_probs = []
                if self.held_k_tokens:
                    r["top_k_tokens"] = FakeArray([self.held_k_tokens])
                    r["top_k_probs"] = FakeArray([self.held_k_probs])
                    self.held_k_tokens, self.held_k_probs = [], []
            if emit_eos or requeue_now:
                assert self.time_first_prefill is not None and self.time_enqueue is not None
                assert self.time_first_token is not None
                self.time_last_token = time.time()
                self.time_enqueued += self.time_first_prefill - self.time_enqueue
                self.time_prefill += self.time_first_token - self.time_first_prefill
                self.time_generate += self.time_last_token - self.time_first_token
            if emit_eos:
                self.is_finished = True
                cached = self.rq_cached or self._cached()
                r.update(
                    {
                        "full_completion": self.full_completion,
                        "new_tokens": self.rq_new_tokens + self.new_tokens,
                        "prompt_tokens": self.rq_prompt_tokens or len(self.input_ids),
                        "time_enqueued": self.time_enqueued,
                        "time_prefill": self.time_prefill,
                        "time_generate": self.time_generate,
                        "cached_pages": cached[0],
                        "cached_tokens": cached[1],
                    }
                )
                if gen.draft_model or gen.ngram_match_min:
                    r["accepted_draft_tokens"] = self.accepted_draft_tokens
                    r["rejected_draft_tokens"] = self.rejected_draft_tokens
                if eos_reason == "stop_string":
                    assert rem_held_text is not None
                    self.held_text = rem_held_text
                rh: dict[str, Any] = {}
                if self.held_text:
                    rh["text"] = self.held_text
                if self.held_tokens:
                    rh["token_ids"] = FakeTensor(self.held_tokens)
                if self.held_probs:
                    rh["token_probs"] = FakeArray([self.held_probs])
                if self.held_k_tokens:
                    rh["top_k_tokens"] = FakeArray([self.held_k_tokens])
                    rh["top_k_probs"] = FakeArray([self.held_k_probs])
                if rh:
                    r["held"] = rh
            if self.identifier is not None:
                r["identifier"] = self.identifier
            results.append(r)
            return emit_eos, requeue_now

        held_text_before = self.held_text
        self.held_text += gen.tokenizer.get_id_to_piece_list(self.decode_special_tokens)[token]
        self.held_tokens.append(token)
        # job.py:981-985
        if self.return_probs:
            assert prob is not None
            self.held_probs.append(prob)
        if self.return_top_tokens > 0:
            assert k_tokens is not None and k_probs is not None
            self.held_k_tokens.append(k_tokens)
            self.held_k_probs.append(k_probs)
        if token in self.stop_tokens:
            return emit(emit_eos=True, eos_reason="stop_token", stop_token=token)
        assert self.max_new_tokens is not None
        if self.new_tokens >= self.max_new_tokens:
            return emit(emit_eos=True, emit_held=True, eos_reason="max_new_tokens")
        if filter_eos_condition:
            # job.py:1001-1002
            return emit(emit_eos=True, emit_held=True, eos_reason="end_filter")
        if "\ufffd" in self.held_text:
            test = gen.tokenizer.decode(
                FakeTensor(self.held_tokens), decode_special_tokens=self.decode_special_tokens
            )[0]
            if test.endswith("\ufffd") and len(test) <= self.stop_string_max_length + 20:
                return emit()
            self.held_text = test
        if requeue_now:
            self.checkpoint = None  # job.py:1133-1134
        elif self.banned_strings and self.new_tokens > 0:
            # job.py:1136-1159
            found = _partial_strings_match(self.held_text.lower(), self.banned_strings)
            if found == -1:
                self.checkpoint = None
            else:
                self._set_checkpoint(held_text_before, token)
                if found >= 0:
                    self._rewind_checkpoint()
                    return emit(emit_held=True)
                return emit()
        if self.stop_strings:
            match = _partial_strings_match(self.held_text, sorted(self.stop_strings))
            if match >= 0:
                held = self.held_text[match:]
                self.held_text = self.held_text[:match]
                for s in self.stop_strings:
                    if held.startswith(s):
                        return emit(
                            emit_eos=True,
                            emit_held=True,
                            eos_reason="stop_string",
                            stop_string=s,
                            rem_held_text=held,
                        )
                raise AssertionError("Detected stop string but couldn't identify it (logic error)")
            if match == -2:
                return emit()
        return emit(emit_held=True)

    def _set_checkpoint(self, held_text_before: str, token: int) -> None:
        """``set_checkpoint`` (``job.py:1023-1042``): where a possible banned string began."""
        cp = self.checkpoint
        if cp is None:
            self.checkpoint = {
                "offset": 1,
                "held_text": held_text_before,
                "held_tokens": self.held_tokens[:-1],
                "held_probs": self.held_probs[:-1],
                "held_k_tokens": self.held_k_tokens[:-1],
                "held_k_probs": self.held_k_probs[:-1],
                "explored_tokens": [token],
            }
        else:
            cp["offset"] += 1
            if cp["offset"] == 1:
                cp["explored_tokens"].append(token)

    def _rewind_checkpoint(self) -> None:
        """``rewind_checkpoint`` (``job.py:1044-1128``) for an attention cache: the
        ``offset`` tokens since the checkpoint leave the sequence, its pages and the
        filters; the held buffers go back to the checkpoint's, which stays (offset 0,
        buffers empty) so that a second failure bans one more token there. A rewind
        into a page that was already hashed is not modelled (1.6.5 defers hashing
        while a checkpoint holds tokens, ``job.py:828-833``)."""
        cp = self.checkpoint
        assert cp is not None
        offset = cp["offset"]
        self.new_tokens -= offset
        if self.filters:
            raise NotImplementedError("a banned-string rewind through filters is not modelled")
        for _ in range(offset):
            self.kv_position -= 1
            page = self.allocated_pages[self.kv_position // PAGE_SIZE]
            if page.content_hashed or not page.tokens:
                raise NotImplementedError("a banned-string rewind across a hashed page is not modelled")
            page.tokens.pop()
            page.kv_position -= 1
            self.sequence_ids.pop()
        self.held_text = cp["held_text"]
        self.held_tokens = list(cp["held_tokens"])
        self.held_probs = list(cp["held_probs"])
        self.held_k_tokens = list(cp["held_k_tokens"])
        self.held_k_probs = list(cp["held_k_probs"])
        cp["offset"] = 0
        cp["held_text"] = ""
        for k in ("held_tokens", "held_probs", "held_k_tokens", "held_k_probs"):
            cp[k] = []

    def prepare_for_requeue(self) -> Job:
        """``job.py:1194-1261``: the same object, re-initialised with its sequence as the prompt."""
        gen = self.generator
        assert gen is not None and self.serial_number is not None and self.max_new_tokens is not None
        last_completed = len(self.sequence_ids) - len(self.input_ids)
        rq_state = {
            "stop_strings": self.stop_strings,
            "stop_tokens": self.stop_tokens,
            "held_text": self.held_text,
            "held_tokens": self.held_tokens,
            "held_probs": self.held_probs,
            "held_k_tokens": self.held_k_tokens,
            "held_k_probs": self.held_k_probs,
            "full_completion": self.full_completion,
            "time_enqueued": self.time_enqueued,
            "time_prefill": self.time_prefill,
            "time_generate": self.time_generate,
            "rq_new_tokens": self.rq_new_tokens + self.new_tokens,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "rejected_draft_tokens": self.rejected_draft_tokens,
            "prompt_tokens": self.rq_prompt_tokens or len(self.input_ids),
            "cached": self.rq_cached or self._cached(),
            "client_prompt": self.client_prompt,
            "sam": self.sam,  # job.py:1232
        }
        serial = self.serial_number
        self.__init__(  # type: ignore[misc]
            input_ids=FakeTensor(self.sequence_ids),
            max_new_tokens=self.max_new_tokens - last_completed,
            min_new_tokens=max(self.min_new_tokens - last_completed, 0),
            sampler=self.sampler,
            decode_special_tokens=self.decode_special_tokens,
            return_top_tokens=self.return_top_tokens,
            return_probs=self.return_probs,
            filters=self.filters,
            identifier=self.identifier,
            banned_strings=self.banned_strings,  # job.py:1253
            max_rq_tokens=self.orig_max_rq_tokens,
            rq_state=rq_state,
        )
        self.prepare_for_queue(gen, serial, rq=True)
        return self


# ---------------------------------------------------------------- generator


class Generator:
    """``exllamav3.Generator`` with the exact 1.6.5 parameter list
    (``generator/generator.py:41-73``)."""

    def __init__(
        self,
        model: Model,
        cache: Cache,
        tokenizer: Tokenizer,
        max_batch_size: int = 256,
        max_chunk_size: int = 2048,
        shared_chunk_size: int | None = None,
        prefill_cooldown: int | None = 4,
        max_q_size: int = 8,
        draft_model: Model | None = None,
        draft_cache: Cache | None = None,
        num_draft_tokens: int | None = None,
        show_visualizer: bool = False,
        enable_defrag: bool = True,
        cpu_cache_size: int = 0,
        disk_cache_dir: str | None = None,
        disk_cache_size: int = 50 * 1024**3,
        disk_cache_flush_on_idle: bool = True,
        disk_cache_checkpoint_interval: int = 4096,
        disk_cache_write_interval: float = 2.0,
        recurrent_cache_size: int = 4 * 1024**3,
        recurrent_checkpoint_interval: int | None = None,
        recurrent_checkpoint_interval_pp: int = 32768,
        ngram_match_min: int = 0,
        dynamic_draft_tokens: bool = False,
        draft_confidence: float = 0.4,
        record_draft_stats: bool = False,
        ngram_corpus: str | None = None,
        hybrid_draft_tokens: int = 0,
        draft_max_rows: int = 0,
        sparse_draft_head: int = 0,
    ) -> None:
        if cpu_cache_size or disk_cache_dir or ngram_corpus or hybrid_draft_tokens or sparse_draft_head:
            raise NotImplementedError("feature not modelled by the fake")
        self.model = model
        self.cache = cache
        self.tokenizer = tokenizer
        cache.owner = self
        # A new generator takes the cache over with a fresh page table; the old one is
        # superseded (generator.py:242-245).
        cache.owner_serial += 1
        self.cache_owner_serial = cache.owner_serial
        cfg_vocab = model.config.vocab_size if model.config is not None else VOCAB_SIZE
        self.padded_vocab_size = (cfg_vocab + 31) // 32 * 32  # generator.py:239
        self.pagetable = _PageTable(cache.max_num_tokens // PAGE_SIZE)
        self.max_total_tokens = PAGE_SIZE * self.pagetable.max_pages
        self.draft_model = draft_model
        self.draft_cache = draft_cache
        self.mtp_draft = bool(draft_model is not None and draft_model.caps.get("mtp_draft", False))
        if draft_model:
            assert not ngram_match_min, "Cannot use both draft model and n-gram draft."
            assert draft_cache is not None, "Must supply cache for draft model"
            assert draft_cache.max_num_tokens == cache.max_num_tokens, (
                "Cache and draft cache must be same size"
            )
            self.num_draft_tokens = num_draft_tokens or int(draft_model.caps.get("default_draft_size", 4))
        elif ngram_match_min:
            self.num_draft_tokens = num_draft_tokens if num_draft_tokens is not None else 4
        else:
            self.num_draft_tokens = 0
        self.ngram_match_min = ngram_match_min
        self.max_draft_tokens = self.num_draft_tokens
        self.max_batch_size = max_batch_size
        self.max_chunk_size = max_chunk_size
        if shared_chunk_size is None:
            shared_chunk_size = (max_chunk_size // 2 + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
        assert 0 < shared_chunk_size <= max_chunk_size and shared_chunk_size % PAGE_SIZE == 0, (
            "shared_chunk_size must be a multiple of the page size (256) and no larger than max_chunk_size"
        )
        self.shared_chunk_size = shared_chunk_size
        self.prefill_cooldown = 4 if prefill_cooldown is None else prefill_cooldown
        self.prefill_cooldown_left = 0
        self.prefill_rotation = 0
        self.job_serial = 0
        self.pending_jobs: list[Job] = []
        self.active_jobs: list[Job] = []
        # Filter masks run here, off the thread that calls iterate() (generator.py:318-320).
        self.filter_pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="exllamav3-filter")
        self.closed = False
        self.fail_next_iterate: Exception | None = None
        self.iterations = 0

    def num_remaining_jobs(self) -> int:
        return len(self.pending_jobs) + len(self.active_jobs)

    def num_active_jobs(self) -> int:
        return len(self.active_jobs)

    def num_pending_jobs(self) -> int:
        return len(self.pending_jobs)

    def enqueue(self, job: Job) -> int:
        job.prepare_for_queue(self, self.job_serial)
        self.job_serial += 1
        self.pending_jobs.append(job)
        assert job.serial_number is not None
        return job.serial_number

    def cancel(self, job: Job) -> None:
        if job in self.pending_jobs:
            self.pending_jobs.remove(job)
        elif job in self.active_jobs:
            job.deallocate_pages()
            self.active_jobs.remove(job)

    def close(self) -> None:
        """``generator.py:839-871``: releases host buffers; model and cache stay loaded for a
        replacement generator; the filter pool is shut down without waiting (``871``).
        Stricter here: a closed generator refuses ``iterate``."""
        self.closed = True
        self.filter_pool.shutdown(wait=False)

    def _reap(self, job: Job, error: Exception, results: list[dict[str, Any]]) -> None:
        job.deallocate_pages()
        if job in self.active_jobs:
            self.active_jobs.remove(job)
        # No "identifier" key here, unlike every other result.
        results.append(
            {"job": job, "serial": job.serial_number, "stage": "error", "eos": True, "error": error}
        )

    def _start_jobs(self, results: list[dict[str, Any]]) -> None:
        batch = len(self.active_jobs)
        free = self.pagetable.num_unreferenced_pages()
        if not (free and self.pending_jobs and batch < self.max_batch_size):
            return
        skipped: list[Job] = []
        for job in list(self.pending_jobs):
            if 1 + batch > self.max_batch_size or (
                job.current_new_pages_required() > self.pagetable.num_unreferenced_pages()
            ):
                skipped.append(job)
                continue
            # max_skips=None fails this comparison with TypeError in 1.6.5 too (generator.py:2196).
            if any(j.skips >= j.max_skips for j in skipped):  # type: ignore[operator]
                return
            for j in skipped:
                j.skips += 1
            self.pending_jobs.remove(job)
            self.active_jobs.append(job)
            job.activate()
            try:
                job.allocate_pages()
            except Exception as e:
                self._reap(job, e, results)
                continue
            batch += 1
            r: dict[str, Any] = {"job": job, "stage": "started", "eos": False, "serial": job.serial_number}
            if job.identifier is not None:
                r["identifier"] = job.identifier
            results.append(r)

    def iterate(self) -> list[dict[str, Any]]:
        assert self.cache.initialized, (
            "Cache tensors were never allocated. Construct the Cache BEFORE calling model.load()"
        )
        if self.cache.owner_serial != self.cache_owner_serial:
            # generator.py:741-749: a superseded generator drops its jobs and refuses to run.
            self.pending_jobs.clear()
            self.active_jobs.clear()
            raise RuntimeError(
                "This Generator no longer owns its Cache: a newer Generator was created over the same "
                "Cache. Close or discard the old Generator before creating a new one."
            )
        if self.closed:
            raise RuntimeError("iterate() on a closed Generator")
        if self.model.device_error is not None:
            raise self.model.device_error
        self.iterations += 1
        if self.fail_next_iterate is not None:
            e, self.fail_next_iterate = self.fail_next_iterate, None
            raise e
        results: list[dict[str, Any]] = []
        self._start_jobs(results)

        prefilling = [j for j in self.active_jobs if not j.is_prefill_done()]
        chunk_size = None
        deferred: list[Job] = []
        if (
            prefilling
            and len(prefilling) < len(self.active_jobs)
            and (self.shared_chunk_size < self.max_chunk_size or self.prefill_cooldown > 0)
        ):
            if self.shared_chunk_size < self.max_chunk_size:
                chunk_size = self.shared_chunk_size
            if self.prefill_cooldown_left > 0:
                self.prefill_cooldown_left -= 1
                deferred = prefilling
            else:
                self.prefill_cooldown_left = self.prefill_cooldown
                selected = prefilling[self.prefill_rotation % len(prefilling)]
                self.prefill_rotation += 1
                deferred = [j for j in prefilling if j is not selected]
        else:
            self.prefill_cooldown_left = 0
        for job in list(self.active_jobs):
            if any(job is d for d in deferred):
                continue
            try:
                job.prefill(results, chunk_size)
            except Exception as e:
                self._reap(job, e, results)

        self._decode(results)
        return results

    def _launch_filters(self, job: Job) -> None:
        """Start the masks of the job's next position: on the filter pool for filters that
        ``use_background_worker()`` (every ``LLGuidanceFilter``), inline for the others
        (``generator.py:1703-1712``, ``1743-1751`` for the first position; ``1969-1979``
        after each accepted draft token). ``Job.prepare_logit_mask`` collects them."""
        assert not job.filter_futures and not job.logit_masks
        for f in job.filters:
            if not f.is_active:
                continue
            if f.use_background_worker():
                job.filter_futures.append(self.filter_pool.submit(f.get_next_logit_mask))
                job.logit_masks.append(None)
            else:
                job.filter_futures.append(None)
                job.logit_masks.append(f.get_next_logit_mask())

    def _sample(self, job: Job) -> tuple[int, int]:
        """``(sampled token, the model's own choice)``. The script's choice stands for the
        largest raw logit (``raw_probs``). The logit mask (``Job.prepare_logit_mask``: filters,
        stop tokens before ``min_new_tokens``) is applied before the sampler stack
        (``sampler/custom.py:1247-1258``), whose first step is the logit bias
        (``generator/sampler/presets.py``, ``ComboSampler``): a bias of ``DOMINANT_BIAS`` or more
        outweighs the script's choice where the mask allows the biased token. A masked choice
        falls to the model's next preference: a space for a stop token held back by
        ``min_new_tokens``, else the allowed token with the lowest id."""
        generated = job.sequence_ids[len(job.client_prompt) :]
        choice = self.model.script(job.client_prompt, generated)
        job.prepare_logit_mask()
        allowed = job.logit_mask
        candidates = []
        bias = job.sampler.settings.get("logit_bias") or {}
        # A bias of -inf is a ban: LogitBias keeps it (sampler/custom.py:600-609) and the
        # token's probability is 0 whatever the model prefers.
        banned = {t for t, b in bias.items() if b == -math.inf}
        if bias:
            top = max(bias, key=lambda t: bias[t])
            if bias[top] >= DOMINANT_BIAS:
                candidates.append(top)
        candidates.append(choice)
        if job.new_tokens < job.min_new_tokens and choice in job.stop_tokens:
            candidates.append(0x20)
        for token in candidates:
            if (allowed is None or token in allowed) and token not in banned:
                return token, choice
        pool = allowed if allowed is not None else range(VOCAB_SIZE)
        in_vocab = sorted(t for t in pool if t < VOCAB_SIZE and t not in banned)
        # Everything masked: the sampler's argmax over -inf picks id 0.
        return (in_vocab[0] if in_vocab else 0), choice

    def _drafts(self, batch: list[Job]) -> dict[int, list[int]] | None:
        w = self.num_draft_tokens
        if self.draft_model is not None:
            drafts = {}
            for job in batch:
                generated = job.sequence_ids[len(job.client_prompt) :]
                d: list[int] = []
                for _ in range(w):
                    d.append(self.draft_model.script(job.client_prompt, generated + d))
                drafts[id(job)] = d
            return drafts
        if self.ngram_match_min:
            raw = {id(job): job.ngram_draft(w, self.ngram_match_min) for job in batch}
            n = min(len(d) for d in raw.values())
            return None if n == 0 else {k: d[:n] for k, d in raw.items()}
        return None

    def _decode(self, results: list[dict[str, Any]]) -> None:
        batch = [j for j in self.active_jobs if j.is_prefill_done()]
        if not batch:
            return
        for job in batch:
            if job.time_first_token is None:
                job.time_first_token = time.time()
        drafts = self._drafts(batch)
        for job in batch:
            self._launch_filters(job)  # "GPU workload is scheduled here"
        completed: list[Job] = []
        requeuing: list[Job] = []
        for job in batch:
            draft = drafts[id(job)] if drafts is not None else []
            width = len(draft) + 1
            for i in range(width):
                nonfinite = self.model.nonfinite
                if job.new_tokens < 1 and nonfinite is not None and nonfinite(job.client_prompt):
                    raise NonFiniteLogits(
                        f"Job {job.identifier!r} (serial {job.serial_number}) produced non-finite logits"
                    )
                token, choice = self._sample(job)
                prob = k_tokens = k_probs = None
                if job.return_probs or job.return_top_tokens > 0:
                    probs = raw_probs(choice)
                    prob = probs[token]
                    if job.return_top_tokens > 0:
                        top = top_k(probs, job.return_top_tokens)
                        k_tokens, k_probs = [t for t, _ in top], [p for _, p in top]
                eos, rq = job.receive_sample(token, results, prob, k_tokens, k_probs)
                if rq:
                    job.rejected_draft_tokens += width - 1 - i
                    requeuing.append(job)
                    break
                if eos:
                    unresolved = width - 1 - i
                    if unresolved:
                        job.rejected_draft_tokens += unresolved
                        for r in reversed(results):
                            if r.get("eos") and r["job"] is job:
                                if "rejected_draft_tokens" in r:
                                    r["rejected_draft_tokens"] = job.rejected_draft_tokens
                                break
                    completed.append(job)
                    break
                if i < width - 1:
                    if draft[i] != token:
                        job.rejected_draft_tokens += width - 1 - i
                        break
                    job.accepted_draft_tokens += 1
                    self._launch_filters(job)
        for job in completed + requeuing:
            job.deallocate_pages()
            self.active_jobs.remove(job)
        for job in requeuing:
            self.pending_jobs.insert(0, job.prepare_for_requeue())


# ---------------------------------------------------------------- test helpers


def _int32_words(n: int) -> Any:
    """A ``(1, n)`` int32 mask of zeros (numpy where 1.6.5 has a CPU torch tensor)."""
    import numpy as np

    return np.zeros((1, n), dtype=np.int32)


def make_handle(
    *,
    script: Script = DEFAULT_SCRIPT,
    cache_tokens: int = 4096,
    max_position_embeddings: int = 8192,
    max_chunk_size: int = 512,
    max_batch_size: int = 8,
    drafting: str | None = None,
    num_draft_tokens: int | None = None,
    ngram_match_min: int = 2,
    draft_script: Script | None = None,
    fail_prefill: Callable[[Sequence[int]], bool] | None = None,
    eos_token_ids: tuple[int, ...] = (EOS, IM_END),
    stop_strings: tuple[str, ...] = (),
    special_pieces: bool = True,
    chat_template: str | None = None,
) -> Any:
    """An ``EngineHandle`` over a fake generator, as ``loader.load_engine`` would build it.
    The generator is ``handle.generator`` (a ``Generator``); ``rebuild_generator`` makes a
    new one over the same model and cache, as the loader's does, and ``check_device`` raises
    ``model.device_error`` (``handle.generator.model``) once it is set. Chat renders with
    ``ChatMLTemplate``, or with a real ``transformers`` tokenizer holding ``chat_template``
    when one is given (``hf_tokenizer``). Grammars use ``LLGuidanceFilter`` as the loader
    does (``grammar.contained_filter_class``)."""
    from engine_worker.exllamav3.chat_template import chat_encoder
    from engine_worker.exllamav3.engine import EngineHandle
    from engine_worker.exllamav3.grammar import budget_filter_factory, contained_filter_class, filter_factory

    model = Model(script=script, fail_prefill=fail_prefill)
    cache = Cache(model, cache_tokens)
    draft_model = draft_cache = None
    if drafting in ("draft_model", "mtp"):
        draft_model = Model(
            component="text" if drafting == "draft_model" else "mtp", script=draft_script or script
        )
        draft_cache = Cache(draft_model, cache_tokens)
    model.load()
    if draft_model is not None:
        draft_model.load()
    tok = Tokenizer(special_pieces=special_pieces)
    if chat_template is not None:
        tok.hf_tokenizer = hf_tokenizer(chat_template)
    gen_kwargs: dict[str, Any] = {
        "model": model,
        "cache": cache,
        "tokenizer": tok,
        "max_batch_size": max_batch_size,
        "max_chunk_size": max_chunk_size,
        "draft_model": draft_model,
        "draft_cache": draft_cache,
        "num_draft_tokens": num_draft_tokens,
        "ngram_match_min": ngram_match_min if drafting == "ngram" else 0,
    }
    gen = Generator(**gen_kwargs)
    current = [gen]

    def encode(text: str, add_bos: bool) -> FakeTensor:
        return tok.encode(text, add_bos=add_bos and not text.startswith("<s>"), encode_special_tokens=True)

    # As the loader builds it: rendered to text, tokenized in pieces (chat_template.chat_encoder).
    encode_chat = chat_encoder(
        tok.hf_tokenizer if chat_template is not None else ChatMLTemplate(), tok, FakeTensor
    )

    def decode(ids: list[int]) -> str:
        return str(tok.decode(FakeTensor(ids, flat=True), decode_special_tokens=True))

    def decode_plain(ids: list[int]) -> str:
        return str(tok.decode(FakeTensor(ids, flat=True), decode_special_tokens=False))

    def rebuild_generator() -> Generator:
        current[0].close()
        current[0] = Generator(**gen_kwargs)
        return current[0]

    def check_device() -> None:
        if model.device_error is not None:
            raise model.device_error

    return EngineHandle(
        generator=gen,
        new_job=Job,
        new_sampler=ComboSampler,
        new_xtc_sampler=functools.partial(xtc_sampler, sys.modules[__name__], tok),
        encode=encode,
        encode_chat=encode_chat,
        decode=decode,
        decode_plain=decode_plain,
        pieces=tok.get_id_to_piece_list(True),
        eos_token_ids=eos_token_ids,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=max_position_embeddings,
        cache_tokens=gen.max_total_tokens,
        max_draft_tokens=gen.max_draft_tokens,
        drafting=drafting,
        model_id="fake-exl3",
        close=lambda: current[0].close(),
        max_batch_size=max_batch_size,
        stop_strings=stop_strings,
        rebuild_generator=rebuild_generator,
        check_device=check_device,
        chat_template=chat_template if chat_template is not None else CHATML_TEMPLATE,
        new_filter=filter_factory(contained_filter_class(LLGuidanceFilter), tok),
        ll_tokenizer=lambda: create_ll_tokenizer(tok),
        as_ids=FakeTensor,
        new_budget_filter=budget_filter_factory(Filter, tok, VOCAB_SIZE, _int32_words),
    )
