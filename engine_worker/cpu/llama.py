"""``LlamaRunner``: a lean forward pass of Llama-family models for the CPU engine,
over many sequences at once.

One ``forward`` call runs a flat batch of *segments*: each is some tokens of one
sequence (a prefill chunk, or the last token plus drafted tokens) appended to
that sequence's ``SequenceKV``. Every linear layer runs once over all the
segments' tokens (one weight read per step, whatever the batch size: decode on
CPU is bound by memory bandwidth); attention runs per segment over its own KV,
so sequences of different lengths need no padding.

Weights, by ``Quantization``:

- ``int4`` (default): groups of 32 input weights with a scale and an offset.
  The embedded GGUF is Q4_1 (groups of 32, scale and minimum), so this holds
  the same 16 levels per group the GGUF holds; about a quarter of float32's
  bytes per token. Where the CPU has AVX-512 VNNI (``int4.available()``), the
  products are ``int4.Product``: int8 activations in groups of 32 times the
  codes in integers, scale and minimum in float16 (llama.cpp's Q4_1 x Q8_1
  arithmetic); elsewhere torch's ``_weight_int4pack_mm_for_cpu`` with
  bfloat16 activations, scale and offset in bfloat16.
- ``int8``: one scale per output channel, ``_weight_int8pack_mm``.
- ``none``: the loaded dtype (float32 or bfloat16), ``torch.nn.functional.linear``.

The LM head (tied to the embeddings in SmolLM2, Q8_0 in its GGUF) is int8 with
either quantization (``Int8Head``: float32 logits). Against float32
(``benchmarks/cpu_quality.py``, 409 tokens teacher-forced), int4 with this head
agrees on 93.6% of greedy tokens through the VNNI kernel (KL 0.0034 nats) and
96.8% through torch's (KL 0.0014), both within 0.5% of float32's perplexity.
For the head, an int4 weight (KL 0.029) and one int8 term per row of
activations (it turned SmolLM2's greedy answer to "What is the capital of
France?" away from Paris) were measured and left out. The residual stream,
norms, RoPE, attention and KV cache stay float32.

Prompt chunks of ``DENSE_MIN_TOKENS`` or more run through bfloat16 copies of
the quantized weights (``dense_prefill``): a GEMM over many rows is about 1.7x
faster than the quantized kernels, which take nearly as long per row as alone.
The copies hold two bytes per parameter more.

Batch invariance: a token's logits and KV are bitwise the same whether its
sequence runs alone or batched, and whether a decode position comes alone or in
a verify pass with drafts. The quantized kernels compute each row of a batched
linear as they compute it alone (float32 and bfloat16 GEMMs do not: with
``none`` this holds only approximately); norms and activations are per row;
attention runs per segment, decode positions one query at a time (on VNNI
machines all of a pass's in one ``DecodeAttention`` call per layer, each
by the same arithmetic whatever the others; elsewhere one fused call each: the
fused kernel's result for a row depends on the other rows of its call, and one
bit of difference flips bfloat16 roundings downstream). Prompt chunks start at
fixed offsets (``CpuBackend``), so their masked calls are the same too.
Checked by ``tests/unit/engine_worker/cpu/test_llama.py`` (both int4 kernels).

Supported: ``model_type`` llama, mistral (no sliding window) and qwen2 (q/k/v
biases), SiLU MLP, RMSNorm, any RoPE scaling transformers' rotary embedding
implements. Others raise ``UnsupportedModel``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine_worker.cpu.kernels.attention import DecodeAttention, attention_available
from engine_worker.cpu.kv_cache import SequenceKV
from engine_worker.cpu.quant import (
    ATTENTION_LLVM,
    ATTENTION_SDPA,
    HEAD_FLOAT,
    Int8Head,
    Kernels,
    Quantization,
    QuantizedLinear,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
DENSE_MIN_TOKENS = 32
"""Prompt chunks of at least this many tokens run through the bfloat16 copies of
the weights (``dense_prefill``): from about 8 rows a GEMM beats the quantized
kernels, and from about 32 it pays for reading four times the bytes."""
BLOCK_TOKENS = 16
"""The prefix cache's unit (``CpuBackend``), and how the dense weights cut a prompt
chunk's rows: at multiples of this many positions from the sequence's first
token, the whole blocks in one GEMM and each piece cut by the chunk's ends in
one of its own (``_block_spans``). After a hit that ends on a block boundary
inside a chunk, the chunk's last partial block meets the same GEMM as without
the hit; its whole blocks meet a GEMM of fewer rows, whose rows may differ in
the last bits (a GEMM's row can depend on the rows beside it), and so may
attention's (docs/performance.md#batch-invariance)."""


class UnsupportedModel(Exception):
    """The model's architecture is not one ``LlamaRunner`` implements."""


@dataclass(frozen=True, slots=True)
class Segment:
    """``tokens`` appended to ``kv`` (positions ``kv.length ..``); the logits of the
    last ``logits`` of them are returned (0: none).

    A segment with logits for every token (decode: the last token and drafts)
    attends one query at a time; others (prompt chunks, and any segment with
    ``chunk_tokens`` above 1) in one masked call over the keys up to their end."""

    kv: SequenceKV
    tokens: Sequence[int]
    logits: int
    chunk_tokens: int = 0
    """For a prompt chunk: the length of the whole chunk these tokens end (more
    than ``len(tokens)`` when a prefix-cache hit covered its head). The
    attention call and the dense weights are chosen by it, so a tail takes the
    path the whole chunk would. 0: not given (chosen by ``tokens`` and ``logits``)."""


@dataclass(frozen=True, slots=True)
class QuantizedState:
    """A runner's quantized weights: ``tensors`` by ``"layers.{i}.{qkv,o,gate_up,down}.{part}"``,
    and each linear layer's ``Quantization`` value by
    ``"layers.{i}.{name}"`` (int4 falls back to int8 for some shapes)."""

    tensors: dict[str, torch.Tensor]
    modes: dict[str, str]

    def part(self, key: str) -> dict[str, torch.Tensor]:
        """The tensors under ``key.``, by the rest of their name."""
        prefix = key + "."
        found = {k[len(prefix) :]: v for k, v in self.tensors.items() if k.startswith(prefix)}
        if not found:
            raise KeyError(key)
        return found

    def mode(self, key: str) -> Quantization:
        return Quantization(self.modes[key])


@dataclass(frozen=True, slots=True)
class _Layer:
    """One decoder layer's weights; the norms' weights are stored times
    ``sqrt(hidden_size)`` (``_rms_norm``)."""

    input_norm: torch.Tensor
    qkv: QuantizedLinear
    o: QuantizedLinear
    post_norm: torch.Tensor
    gate_up: QuantizedLinear
    down: QuantizedLinear


def _block_spans(row: int, start: int, n: int) -> list[tuple[int, int]]:
    """Rows ``row .. row + n`` of a pass (positions ``start .. start + n``) as
    spans for the dense weights: the whole ``BLOCK_TOKENS`` blocks of positions
    in one span, and a span each for the pieces of blocks cut by the chunk's
    ends (``BLOCK_TOKENS``)."""
    end = start + n
    head = min(end, -(-start // BLOCK_TOKENS) * BLOCK_TOKENS)  # first block boundary
    whole = head + (end - head) // BLOCK_TOKENS * BLOCK_TOKENS
    cuts = [start, head, whole, end]
    return [(row + a - start, row + b - start) for a, b in itertools.pairwise(cuts) if b > a]


def _rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    n_eps: torch.Tensor,
    out: torch.Tensor,
    scratch: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """RMSNorm of ``x`` ``[tokens, hidden]`` float32 into ``out`` (its dtype: the next
    layer's input), in five kernels that allocate nothing (``F.rms_norm``: seven,
    then a cast): ``x * w / sqrt(mean(x**2) + eps)`` as ``x * (w * sqrt(hidden)) *
    rsqrt(sum(x**2) + hidden * eps)``, with ``weight`` the norm's weight times
    ``sqrt(hidden)``, ``n_eps`` the one-element tensor ``hidden * eps`` and
    ``scratch`` float32 ``([tokens, 1], [tokens, hidden])``. Per row, so a row's
    result does not depend on the others."""
    norm, factor = scratch
    torch.linalg.vector_norm(x, 2, -1, keepdim=True, out=norm)
    torch.addcmul(n_eps, norm, norm, out=norm).rsqrt_()
    torch.mul(norm, weight, out=factor)
    torch.mul(x, factor, out=out)


@dataclass(frozen=True, slots=True)
class _Attention:
    """One attention call of a pass: ``queries`` ``[1, heads, rows, head_dim]``, per
    layer ``keys`` / ``values`` ``[1, kv_heads, end, head_dim]``, a causal ``mask``
    for a prompt chunk, and ``out`` ``[rows, heads, head_dim]``, the rows of the pass's
    attention output it writes."""

    queries: torch.Tensor
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    mask: torch.Tensor | None
    out: torch.Tensor


@dataclass(frozen=True, slots=True)
class _Planned:
    """One segment's place in a pass: rows ``offset .. offset + n`` of the pass,
    positions ``start .. start + n`` of ``kv``, and views of its KV buffer per
    layer, taken once per pass (one ``unbind`` each, not 30 indexing calls).

    ``keys_out`` / ``values_out``: per layer ``[n, kv_heads, head_dim]``, where the
    pass's keys and values go (the layout the pass computes them in).
    ``reads``: per fused attention call, keys and values per layer ``[1, kv_heads,
    end, head_dim]``: one call over ``start + n`` positions with ``mask`` (a prompt
    chunk, causal within it), or one per position (decode; none where
    ``DecodeAttention`` reads the buffer itself: ``fused_decode`` false).
    """

    kv: SequenceKV
    offset: int
    n: int
    start: int
    mask: torch.Tensor | None
    keys_out: tuple[torch.Tensor, ...]
    values_out: tuple[torch.Tensor, ...]
    reads: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]

    @classmethod
    def of(
        cls, kv: SequenceKV, offset: int, n: int, start: int, prompt_chunk: bool, fused_decode: bool
    ) -> _Planned:
        buffer = kv.buffer  # [layers, 2, kv_heads, capacity, head_dim]
        ends = [start + n] if prompt_chunk else range(start + 1, start + n + 1) if fused_decode else []
        # [layers, 1, kv_heads, capacity, head_dim]: the fused attention kernel takes 4-d
        # inputs (3-d ones go to the unfused math path, several times slower).
        keys, values = buffer[:, 0:1], buffer[:, 1:2]
        reads = [(keys[:, :, :, :end].unbind(0), values[:, :, :, :end].unbind(0)) for end in ends]
        mask = None
        if prompt_chunk:
            mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        written = buffer[:, :, :, start : start + n].permute(1, 0, 3, 2, 4)  # [2, layers, n, kv_heads, d]
        return cls(kv, offset, n, start, mask, written[0].unbind(0), written[1].unbind(0), reads)


class LlamaRunner:
    """The forward pass of a transformers Llama-family causal LM, weights copied
    (and quantized) out of ``model`` at construction.

    ``max_positions`` bounds the positions (RoPE table, tokens). ``quantized``, a
    ``quantized_state()`` of an earlier runner over the same weights and options
    (``weight_cache``), replaces the quantization of the linear layers (seconds on
    2 cores, the bulk of a start); ``progress`` is called with the number of layers
    quantized so far. Raises ``UnsupportedModel`` for other architectures, and
    ``KeyError`` for a ``quantized`` state that lacks a tensor.
    """

    def __init__(
        self,
        model: Any,
        quantization: Quantization,
        max_positions: int,
        dense_prefill: bool = True,
        *,
        quantized: QuantizedState | None = None,
        progress: Callable[[int], None] | None = None,
        kernels: Kernels | None = None,
    ) -> None:
        config = model.config.get_text_config(decoder=True)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(
                f"the CPU engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models; this one is {model_type!r}"
            )
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"hidden_act {config.hidden_act!r} is not supported (silu only)")
        window = getattr(config, "sliding_window", None)
        # qwen2 configs carry a window that use_sliding_window leaves off by default
        if window and getattr(config, "use_sliding_window", True) and window < max_positions:
            raise UnsupportedModel(f"sliding-window attention ({window} tokens) is not supported")
        decoder = model.get_decoder()
        self.num_layers = int(config.num_hidden_layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.hidden_size = int(config.hidden_size)
        self.head_dim = int(getattr(config, "head_dim", None) or self.hidden_size // self.num_heads)
        self.vocab_size = int(config.vocab_size)
        self.quantization = quantization
        self.kernels = kernels or Kernels.default(quantization, model.dtype)
        self._eps = float(config.rms_norm_eps)
        self._intermediate = int(config.intermediate_size)
        self._q_width = self.num_heads * self.head_dim
        self._kv_width = self.num_kv_heads * self.head_dim
        self._scale = self.head_dim**-0.5
        self._n_eps = torch.tensor([self.hidden_size * self._eps])  # _rms_norm's
        self._half_swap = torch.tensor([1, 0])  # the halves of a head swapped (RoPE)
        with torch.inference_mode():
            self._embed = decoder.embed_tokens.weight.detach().float()
            self._norm = decoder.norm.weight.detach().float()
            self._dense = dense_prefill and quantization is not Quantization.NONE
            self._restore = quantized
            self._layers = []
            for i, layer in enumerate(decoder.layers):
                self._layers.append(self._layer(i, layer, quantization))
                if progress is not None:
                    progress(i + 1)
            head = model.get_output_embeddings()
            if getattr(head, "bias", None) is not None:
                raise UnsupportedModel("an LM head with a bias is not supported")
            self._head: QuantizedLinear | Int8Head
            if quantization is Quantization.NONE:
                self._head = QuantizedLinear(head.weight, None, quantization)
            else:
                # Not kept in ``quantized``: per-channel int8 takes milliseconds, and
                # oneDNN's packed copy is the kernel's own (Int8Head), so it is made anew.
                self._head = Int8Head(head.weight, self.kernels.head)
            self._restore = None
            # decode attention in one native call per layer where chosen and this
            # machine runs it; it reads and writes float32, the layers' activations
            # with the VNNI kernel (and with float32 weights)
            self._native_attention = (
                self.kernels.attention == ATTENTION_LLVM
                and self._layers[0].qkv.input_dtype == torch.float32
                and attention_available(self.head_dim, self.num_heads, self.num_kv_heads)
            )
            # what runs, as asked where this machine and the shapes allow it
            self.kernels = Kernels(
                self.kernels.head if quantization is not Quantization.NONE else HEAD_FLOAT,
                self._layers[0].qkv.kernel,
                ATTENTION_LLVM if self._native_attention else ATTENTION_SDPA,
            )
            # cos/sin per position from the model's own rotary embedding (any RoPE
            # scaling it implements, attention scaling included).
            positions = torch.arange(max_positions)[None]
            probe = torch.zeros(1, 1, self.head_dim)
            cos, sin = decoder.rotary_emb(probe, positions)
            self._cos = cos[0].float()[:, None, :].contiguous()  # [positions, 1, head_dim]
            sin = sin[0].float()[:, None, :]
            # rotate_half(x) * sin == swap_halves(x) * (sin with its first half negated)
            self._sin_signed = torch.cat(
                (-sin[..., : self.head_dim // 2], sin[..., self.head_dim // 2 :]), -1
            )

    def _linear(
        self, key: str, weight: torch.Tensor, bias: torch.Tensor | None, quantization: Quantization
    ) -> QuantizedLinear:
        if self._restore is not None:
            return QuantizedLinear.from_state(self._restore.part(key), bias, self._restore.mode(key))
        return QuantizedLinear(weight, bias, quantization, self._dense, self.kernels.layers)

    def quantized_state(self) -> QuantizedState:
        """The quantized linear layers, for a later runner's ``quantized`` (the LM
        head is quantized anew: milliseconds)."""
        tensors: dict[str, torch.Tensor] = {}
        modes: dict[str, str] = {}
        for i, layer in enumerate(self._layers):
            for name in ("qkv", "o", "gate_up", "down"):
                linear: QuantizedLinear = getattr(layer, name)
                modes[f"layers.{i}.{name}"] = linear.mode.value
                tensors.update({f"layers.{i}.{name}.{k}": v for k, v in linear.state().items()})
        return QuantizedState(tensors, modes)

    def _layer(self, i: int, layer: Any, quantization: Quantization) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        biases = [p.bias for p in projections]
        if any(b is not None for b in biases):
            bias = torch.cat(
                [
                    b if b is not None else p.weight.new_zeros(p.weight.shape[0])
                    for b, p in zip(biases, projections, strict=True)
                ]
            )
        else:
            bias = None
        restoring = self._restore is not None
        key = f"layers.{i}"
        return _Layer(
            input_norm=layer.input_layernorm.weight.detach().float() * self.hidden_size**0.5,
            qkv=self._linear(
                f"{key}.qkv",
                attn.q_proj.weight if restoring else torch.cat([p.weight for p in projections]),
                bias,
                quantization,
            ),
            o=self._linear(f"{key}.o", attn.o_proj.weight, attn.o_proj.bias, quantization),
            post_norm=layer.post_attention_layernorm.weight.detach().float() * self.hidden_size**0.5,
            gate_up=self._linear(
                f"{key}.gate_up",
                mlp.gate_proj.weight if restoring else torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                None,
                quantization,
            ),
            down=self._linear(f"{key}.down", mlp.down_proj.weight, None, quantization),
        )

    @property
    def max_positions(self) -> int:
        return int(self._cos.shape[0])

    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token (float32 keys and values, every layer)."""
        return SequenceKV.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim)

    def weight_bytes(self) -> int:
        """Bytes of linear-layer weights read per forward pass (LM head included)."""
        total = self._head.nbytes()
        for layer in self._layers:
            total += sum(linear.nbytes() for linear in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return total

    def new_kv(self, capacity: int) -> SequenceKV:
        """An empty KV cache for one sequence, ``capacity`` positions allocated."""
        return SequenceKV(self.num_layers, self.num_kv_heads, self.head_dim, capacity)

    def forward(self, segments: Sequence[Segment]) -> list[torch.Tensor | None]:
        """Run ``segments`` in one pass; per segment its logits
        (``[logits, vocab]`` float32) or ``None``.

        Each segment's KV grows by its token count, committed only when the whole
        pass succeeds: after an exception every ``kv.length`` is unchanged (the
        positions written are overwritten by the next pass). Raises
        ``ValueError`` past ``max_positions``.
        """
        for seg in segments:
            n, start = len(seg.tokens), seg.kv.length
            if n == 0:
                raise ValueError("a segment needs at least one token")
            if start + n > self.max_positions:
                raise ValueError(f"position {start + n} is past the model's {self.max_positions}")
        # Long prompt chunks go last, each through the dense weights on its own
        # rows (the same call whatever else is in the pass); the rest first,
        # through the quantized kernels in one call.
        prompt = [
            seg.chunk_tokens > 1 if seg.chunk_tokens else 1 < len(seg.tokens) != seg.logits
            for seg in segments
        ]
        dense = [
            self._dense and p and max(len(seg.tokens), seg.chunk_tokens) >= DENSE_MIN_TOKENS
            for p, seg in zip(prompt, segments, strict=True)
        ]
        order = [i for i, d in enumerate(dense) if not d] + [i for i, d in enumerate(dense) if d]
        ids: list[int] = []
        positions: list[int] = []
        plan: list[_Planned] = []
        spans: list[tuple[int, int]] = []  # rows of the dense chunks, cut at block boundaries
        for i in order:
            seg = segments[i]
            n, start = len(seg.tokens), seg.kv.length
            seg.kv.reserve(start + n)
            if dense[i]:
                spans += _block_spans(len(ids), start, n)
            plan.append(
                _Planned.of(
                    seg.kv,
                    len(ids),
                    n,
                    start,
                    prompt_chunk=prompt[i],
                    fused_decode=not self._native_attention,
                )
            )
            ids.extend(seg.tokens)
            positions.extend(range(start, start + n))
        quantized_rows = spans[0][0] if spans else len(ids)

        def split(layer: QuantizedLinear, h: torch.Tensor) -> torch.Tensor:
            parts = [layer.raw(h[:quantized_rows])] if quantized_rows else []
            parts += [layer.dense_raw(h[a:b]) for a, b in spans]
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        def whole(layer: QuantizedLinear, h: torch.Tensor) -> torch.Tensor:
            return layer.raw(h)

        linear = split if spans else whole  # no slicing of the rows when no chunk is dense

        index = torch.tensor(positions)
        cos, sin = self._cos[index], self._sin_signed[index]
        x = self._embed[torch.tensor(ids)]
        tokens = len(ids)
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        half, qk_heads, q_width = d // 2, heads + kv_heads, self._q_width
        scale, intermediate, n_eps = self._scale, self._intermediate, self._n_eps
        qk_width = q_width + self._kv_width
        # Every intermediate of a layer lives in a buffer made once per pass and
        # written by the op that computes it (out=), and every view of them is taken
        # here: a decode pass is ~30 small ops per layer around the matrix
        # products, and allocations, casts and view calls were a third of them.
        # The inputs of the linear layers are written in the dtype they take.
        act = self._layers[0].qkv.input_dtype
        normed = torch.empty(tokens, self.hidden_size, dtype=act)
        attended = torch.empty(tokens, heads, d, dtype=act)
        gated = torch.empty(tokens, intermediate, dtype=act)
        flat = attended.view(tokens, q_width)
        norm_scratch = (torch.empty(tokens, 1), torch.empty(tokens, self.hidden_size))
        qkv = torch.empty(tokens, qk_width + self._kv_width)  # float32
        qk = qkv[:, :qk_width].view(tokens, qk_heads, d)
        values = qkv[:, qk_width:].view(tokens, kv_heads, d)
        # RoPE, rotate_half(x) * sin as the halves swapped times sin with its first
        # half negated.
        swapped, cos_term, rotated = (torch.empty(tokens, qk_heads, d) for _ in range(3))
        halves, swapped_halves = qk.view(tokens, qk_heads, 2, half), swapped.view(tokens, qk_heads, 2, half)
        queries = rotated[:, :heads].transpose(0, 1)[None]  # [1, heads, T, d]
        gate_up = torch.empty(tokens, 2 * intermediate)  # float32
        gate, up, activated = (
            gate_up[:, :intermediate],
            gate_up[:, intermediate:],
            torch.empty(tokens, intermediate),
        )
        # Per segment: where its new keys and values come from, and its attention
        # calls (queries, reads, mask, where the output goes).
        calls: list[tuple[_Planned, torch.Tensor, torch.Tensor, list[_Attention]]] = []
        # Decode positions attend through one native call per layer for all of them
        # where this machine runs it, else one fused call each.
        decode_items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        for p in plan:
            own = slice(p.offset, p.offset + p.n)
            if p.mask is not None:
                keys, vals = p.reads[0]
                attention = [_Attention(queries[:, :, own], keys, vals, p.mask, attended[own])]
            elif self._native_attention:
                # each position over the keys up to its own, as a lone decode step reads them
                attention = []
                decode_items += [
                    (rotated[i, :heads], p.kv.buffer, attended[i], p.start + j + 1)
                    for j, i in enumerate(range(p.offset, p.offset + p.n))
                ]
            else:
                # Decode positions, one query at a time: each is computed exactly as
                # plain decoding computes it (a verify pass's position included).
                attention = [
                    _Attention(queries[:, :, i : i + 1], keys, vals, None, attended[i : i + 1])
                    for i, (keys, vals) in enumerate(p.reads, start=p.offset)
                ]
            calls.append((p, rotated[own, heads:], values[own], attention))
        decode = DecodeAttention(d, heads, kv_heads, scale, decode_items) if decode_items else None
        half_swap = self._half_swap
        for li, layer in enumerate(self._layers):
            _rms_norm(x, layer.input_norm, n_eps, normed, norm_scratch)
            qkv.copy_(linear(layer.qkv, normed))
            torch.index_select(halves, 2, half_swap, out=swapped_halves)
            torch.mul(qk, cos, out=cos_term)
            torch.addcmul(cos_term, swapped, sin, out=rotated)
            for p, new_keys, new_values, attention in calls:
                p.keys_out[li].copy_(new_keys)
                p.values_out[li].copy_(new_values)
                for a in attention:
                    out = F.scaled_dot_product_attention(
                        a.queries, a.keys[li], a.values[li], attn_mask=a.mask, scale=scale, enable_gqa=True
                    )
                    a.out.copy_(out[0].transpose(0, 1))
            if decode is not None:
                decode(li)
            # bfloat16 outputs added to the float32 stream are widened exactly first
            x.add_(linear(layer.o, flat))
            _rms_norm(x, layer.post_norm, n_eps, normed, norm_scratch)
            gate_up.copy_(linear(layer.gate_up, normed))
            torch._C._nn.silu(gate, out=activated)  # type: ignore[call-arg]  # silu.out exists; the stub lacks it
            torch.mul(activated, up, out=gated)
            x.add_(linear(layer.down, gated))
        rows: list[int] = []
        for i, p in zip(order, plan, strict=True):
            rows.extend(range(p.offset + p.n - segments[i].logits, p.offset + p.n))
        logits = None
        if rows:
            last = F.rms_norm(x[torch.tensor(rows)], (self.hidden_size,), self._norm, self._eps)
            logits = self._head(last)
        for p in plan:
            p.kv.length = p.start + p.n
        result: list[torch.Tensor | None] = [None] * len(segments)
        row = 0
        for i in order:
            count = segments[i].logits
            if count:
                assert logits is not None
                result[i] = logits[row : row + count]
                row += count
        return result
