"""``LlamaRunner``: a lean forward pass of Llama-family models for the CPU engine,
over many sequences at once.

One ``forward`` call runs a flat batch of *segments*: each is some tokens of one
sequence (a prefill chunk, or the last token plus drafted tokens) appended to
that sequence's ``SequenceKV``. Every linear layer runs once over all the
segments' tokens (one weight read per step, whatever the batch size: decode on
CPU is bound by memory bandwidth); attention runs per segment over its own KV,
so sequences of different lengths need no padding.

Weights, by ``Quantization``:

- ``int4`` (default): groups of 32 input weights with a scale and an offset,
  torch's ``_weight_int4pack_mm_for_cpu`` with bfloat16 activations. The
  embedded GGUF is Q4_1 (groups of 32, scale and minimum), so this holds the
  same 16 levels per group the GGUF holds (scale and offset rounded to
  bfloat16); about a quarter of float32's bytes per token.
- ``int8``: one scale per output channel, ``_weight_int8pack_mm``.
- ``none``: the loaded dtype (float32 or bfloat16), ``torch.nn.functional.linear``.

The LM head (tied to the embeddings in SmolLM2, Q8_0 in its GGUF) is int8 with
either quantization (``Int8Head``: float32 logits). Measured against float32 on
600 tokens of English text (teacher-forced): int4 with this head agrees on 98.8%
of greedy tokens, KL 0.0006 nats, the same perplexity to 0.1%. An
int4 head (KL 0.029) and int8 x one-term int8 activations (it turned SmolLM2's
greedy answer to "What is the capital of France?" away from Paris) were
measured and left out. The residual stream, norms, RoPE, attention and KV
cache stay float32.

Prompt chunks of ``DENSE_MIN_TOKENS`` or more run through bfloat16 copies of
the quantized weights (``dense_prefill``): a GEMM over many rows is about 1.7x
faster than the quantized kernels, which take nearly as long per row as alone.
The copies hold two bytes per parameter more.

Batch invariance: a token's logits and KV are bitwise the same whether its
sequence runs alone or batched, and whether a decode position comes alone or in
a verify pass with drafts. The quantized kernels compute each row of a batched
linear as they compute it alone (float32 and bfloat16 GEMMs do not: with
``none`` this holds only approximately); norms and activations are per row;
attention runs per segment, decode positions one query at a time (the fused
kernel's result for a row depends on the other rows of its call, and one bit
of difference flips bfloat16 roundings downstream). Prompt chunks start at
fixed offsets (``CpuBackend``), so their masked calls are the same too.
Checked by ``tests/unit/engine_worker/cpu/test_llama.py``.

Supported: ``model_type`` llama, mistral (no sliding window) and qwen2 (q/k/v
biases), SiLU MLP, RMSNorm, any RoPE scaling transformers' rotary embedding
implements. Others raise ``UnsupportedModel``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine_worker.cpu.kv_cache import SequenceKV

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_INT4_GROUP = 32  # input weights sharing one scale and offset (Q4_1's block)
DENSE_MIN_TOKENS = 32
"""Prompt chunks of at least this many tokens run through the bfloat16 copies of
the weights (``dense_prefill``): from about 8 rows a GEMM beats the quantized
kernels, and from about 32 it pays for reading four times the bytes."""


class Quantization(enum.StrEnum):
    """Weight-only quantization of the linear layers (``--quantization``)."""

    INT4 = "int4"
    INT8 = "int8"
    NONE = "none"


class UnsupportedModel(Exception):
    """The model's architecture is not one ``LlamaRunner`` implements."""


class QuantizedLinear:
    """``y = x @ W.T (+ b)`` for ``x`` ``[tokens, in]`` float32, ``y`` ``[tokens, out]`` float32.

    ``mode`` ``int4``/``int8`` quantize ``weight`` (``[out, in]``) once here;
    shapes the int4 kernel cannot take (``in`` not a multiple of 32) fall back
    to int8. ``none`` keeps ``weight`` in its dtype. With ``dense``, a quantized
    layer also keeps a bfloat16 copy for ``dense_call`` (prompt chunks).
    """

    __slots__ = ("_bias", "_dense", "_int4_scales", "_int8_scales", "_mode", "_weight")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, mode: Quantization, dense: bool = False
    ) -> None:
        weight = weight.detach()
        in_features = weight.shape[1]
        if mode is Quantization.INT4 and in_features % _INT4_GROUP != 0:
            mode = Quantization.INT8
        self._mode = mode
        self._bias = None if bias is None else bias.detach().float()
        self._int4_scales: torch.Tensor | None = None
        self._int8_scales: torch.Tensor | None = None
        if mode is Quantization.INT4:
            self._weight, self._int4_scales = _pack_int4(weight.float())
        elif mode is Quantization.INT8:
            w = weight.float()
            scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
            self._weight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            self._int8_scales = scales.to(torch.bfloat16)
        else:
            self._weight = weight.contiguous()
        self._dense = (
            weight.to(torch.bfloat16).contiguous() if dense and mode is not Quantization.NONE else None
        )

    @property
    def mode(self) -> Quantization:
        return self._mode

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors this layer computes with (bias aside: it comes from the model
        unchanged), by name, for ``from_state``; what ``weight_cache`` stores."""
        out = {"weight": self._weight}
        for name, tensor in (
            ("int4_scales", self._int4_scales),
            ("int8_scales", self._int8_scales),
            ("dense", self._dense),
        ):
            if tensor is not None:
                out[name] = tensor
        return out

    @classmethod
    def from_state(
        cls, state: Mapping[str, torch.Tensor], bias: torch.Tensor | None, mode: Quantization
    ) -> QuantizedLinear:
        """The layer ``state()`` described (``mode`` as it was after any int4 -> int8
        fallback), without quantizing anything again."""
        self = cls.__new__(cls)
        self._mode = mode
        self._bias = None if bias is None else bias.detach().float()
        self._weight = state["weight"]
        self._int4_scales = state.get("int4_scales")
        self._int8_scales = state.get("int8_scales")
        self._dense = state.get("dense")
        return self

    def dense_call(self, x: torch.Tensor) -> torch.Tensor:
        """``y`` from the bfloat16 copy (``dense=True``): a GEMM that pays off over
        many rows, where the quantized kernels take about as long per row as alone."""
        assert self._dense is not None
        y = F.linear(x.to(torch.bfloat16), self._dense).float()
        if self._bias is not None:
            y += self._bias
        return y

    def nbytes(self) -> int:
        """Bytes of weight data read per forward pass."""
        total = self._weight.numel() * self._weight.element_size()
        for extra in (self._int4_scales, self._int8_scales, self._bias):
            if extra is not None:
                total += extra.numel() * extra.element_size()
        return total

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor
        if self._mode is Quantization.INT4:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self._weight, _INT4_GROUP, self._int4_scales
            ).float()
        elif self._mode is Quantization.INT8:
            y = torch.ops.aten._weight_int8pack_mm(
                x.to(torch.bfloat16), self._weight, self._int8_scales
            ).float()
        else:
            y = F.linear(x.to(self._weight.dtype), self._weight).float()
        if self._bias is not None:
            y += self._bias
        return y


class Int8Head:
    """The LM head: ``[tokens, hidden]`` float32 -> ``[tokens, vocab]`` float32 logits.

    Weights int8 with a scale per output channel (the embedded GGUF's embedding
    is Q8_0); activations as two int8 terms per token, ``x ~ s1*q1 + s2*q2``
    (the second quantizes what the first left over: about 14 bits), both rows
    multiplied in one ``torch._int_mm`` call, exact in int32 and VNNI-fast.
    Logits come out in float32: the weight-only int8 kernel returns bfloat16,
    whose 0.125 steps at logit 25 tie SmolLM2's two best first tokens for "What
    is the capital of France?" (0.08 apart in float32), and eight rows cost it
    three times one row where this head takes about 2.7 times.
    """

    __slots__ = ("_scales", "_weight_t")

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        self._scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        # [hidden, vocab], a transposed view of [vocab, hidden]: _int_mm's fastest layout here
        self._weight_t = torch.round(w / self._scales[:, None]).clamp(-127, 127).to(torch.int8).t()

    def nbytes(self) -> int:
        return self._weight_t.numel() + self._scales.numel() * 4

    def state(self) -> dict[str, torch.Tensor]:
        """``weight`` ``[vocab, hidden]`` int8 (contiguous; kept as its transpose) and ``scales``."""
        return {"weight": self._weight_t.t(), "scales": self._scales}

    @classmethod
    def from_state(cls, state: Mapping[str, torch.Tensor]) -> Int8Head:
        self = cls.__new__(cls)
        self._scales = state["scales"]
        self._weight_t = state["weight"].t()
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        high_scale = (x.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-30)
        high = torch.round(x / high_scale)
        rest = x - high * high_scale
        low_scale = (rest.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-30)
        low = torch.round(rest / low_scale)
        products = torch._int_mm(torch.cat((high, low)).to(torch.int8), self._weight_t).float()
        return (products[:rows] * high_scale + products[rows:] * low_scale) * self._scales


def _pack_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` float32 as 16 levels per group of 32 inputs: the
    packed codes and ``[in/32, out, 2]`` bfloat16 (scale, offset), the kernel's
    layout, where a weight is ``(code - 8) * scale + offset``."""
    out_features, in_features = weight.shape
    groups = weight.view(out_features, in_features // _INT4_GROUP, _INT4_GROUP)
    low = groups.amin(dim=-1)
    scale = ((groups.amax(dim=-1) - low) / 15.0).clamp(min=1e-12)
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.view(out_features, in_features), 1)
    scales_and_offsets = torch.stack([scale, low + 8.0 * scale], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_offsets.to(torch.bfloat16)


@dataclass(frozen=True, slots=True)
class Segment:
    """``tokens`` appended to ``kv`` (positions ``kv.length ..``); the logits of the
    last ``logits`` of them are returned (0: none).

    A segment with logits for every token (decode: the last token and drafts)
    attends one query at a time; others (prompt chunks) in one masked call."""

    kv: SequenceKV
    tokens: Sequence[int]
    logits: int


@dataclass(frozen=True, slots=True)
class QuantizedState:
    """A runner's quantized weights: ``tensors`` by ``"layers.{i}.{qkv,o,gate_up,down}.{part}"``
    and ``"head.{weight,scales}"``, and each linear layer's ``Quantization`` value by
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
    input_norm: torch.Tensor
    qkv: QuantizedLinear
    o: QuantizedLinear
    post_norm: torch.Tensor
    gate_up: QuantizedLinear
    down: QuantizedLinear


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
        self._eps = float(config.rms_norm_eps)
        self._intermediate = int(config.intermediate_size)
        self._q_width = self.num_heads * self.head_dim
        self._kv_width = self.num_kv_heads * self.head_dim
        self._scale = self.head_dim**-0.5
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
            elif quantized is not None:
                self._head = Int8Head.from_state(quantized.part("head"))
            else:
                self._head = Int8Head(head.weight)
            self._restore = None
            # cos/sin per position from the model's own rotary embedding (any RoPE
            # scaling it implements, attention scaling included).
            positions = torch.arange(max_positions)[None]
            probe = torch.zeros(1, 1, self.head_dim)
            cos, sin = decoder.rotary_emb(probe, positions)
            self._cos = cos[0].float()[:, None, :].contiguous()  # [positions, 1, head_dim]
            self._sin = sin[0].float()[:, None, :].contiguous()

    def _linear(
        self, key: str, weight: torch.Tensor, bias: torch.Tensor | None, quantization: Quantization
    ) -> QuantizedLinear:
        if self._restore is not None:
            return QuantizedLinear.from_state(self._restore.part(key), bias, self._restore.mode(key))
        return QuantizedLinear(weight, bias, quantization, self._dense)

    def quantized_state(self) -> QuantizedState:
        """The quantized linear layers and LM head, for a later runner's ``quantized``."""
        tensors: dict[str, torch.Tensor] = {}
        modes: dict[str, str] = {}
        for i, layer in enumerate(self._layers):
            for name in ("qkv", "o", "gate_up", "down"):
                linear: QuantizedLinear = getattr(layer, name)
                modes[f"layers.{i}.{name}"] = linear.mode.value
                tensors.update({f"layers.{i}.{name}.{k}": v for k, v in linear.state().items()})
        if isinstance(self._head, Int8Head):
            tensors.update({f"head.{k}": v for k, v in self._head.state().items()})
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
            input_norm=layer.input_layernorm.weight.detach().float(),
            qkv=self._linear(
                f"{key}.qkv",
                attn.q_proj.weight if restoring else torch.cat([p.weight for p in projections]),
                bias,
                quantization,
            ),
            o=self._linear(f"{key}.o", attn.o_proj.weight, attn.o_proj.bias, quantization),
            post_norm=layer.post_attention_layernorm.weight.detach().float(),
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
        dense = [
            self._dense and len(seg.tokens) >= DENSE_MIN_TOKENS and len(seg.tokens) != seg.logits
            for seg in segments
        ]
        order = [i for i, d in enumerate(dense) if not d] + [i for i, d in enumerate(dense) if d]
        ids: list[int] = []
        positions: list[int] = []
        plan: list[tuple[SequenceKV, int, int, int, torch.Tensor | None]] = []
        spans: list[tuple[int, int]] = []  # rows of the dense chunks
        for i in order:
            seg = segments[i]
            n, start = len(seg.tokens), seg.kv.length
            seg.kv.reserve(start + n)
            mask = None
            if 1 < n != seg.logits:  # a prompt chunk: causal within it, everything before visible
                mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
            if dense[i]:
                spans.append((len(ids), len(ids) + n))
            plan.append((seg.kv, len(ids), n, start, mask))
            ids.extend(seg.tokens)
            positions.extend(range(start, start + n))
        quantized_rows = spans[0][0] if spans else len(ids)

        def linear(layer: QuantizedLinear, h: torch.Tensor) -> torch.Tensor:
            if not spans:
                return layer(h)
            parts = [layer(h[:quantized_rows])] if quantized_rows else []
            parts += [layer.dense_call(h[a:b]) for a, b in spans]
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        index = torch.tensor(positions)
        cos, sin = self._cos[index], self._sin[index]
        x = self._embed[torch.tensor(ids)]
        tokens = len(ids)
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        half = d // 2
        q_width, qk_width = self._q_width, self._q_width + self._kv_width
        for li, layer in enumerate(self._layers):
            h = F.rms_norm(x, (self.hidden_size,), layer.input_norm, self._eps)
            qkv = linear(layer.qkv, h)
            qk = qkv[:, :qk_width].view(tokens, heads + kv_heads, d)
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
            # rotated keys back next to the values: one copy writes a segment's KV
            qkv[:, q_width:qk_width] = qk[:, heads:].reshape(tokens, self._kv_width)
            new_kv = qkv[:, q_width:].view(tokens, 2, kv_heads, d).permute(1, 2, 0, 3)  # [2, kv_heads, T, d]
            queries = qk[:, :heads].transpose(0, 1)[None]  # [1, heads, T, d]
            outputs = []
            for kv, offset, n, start, mask in plan:
                buffer = kv.layers[li]  # [2, kv_heads, capacity, d]
                buffer[:, :, start : start + n] = new_kv[:, :, offset : offset + n]
                if mask is not None:
                    outputs.append(
                        F.scaled_dot_product_attention(
                            queries[:, :, offset : offset + n],
                            buffer[None, 0, :, : start + n],
                            buffer[None, 1, :, : start + n],
                            attn_mask=mask,
                            scale=self._scale,
                            enable_gqa=True,
                        )
                    )
                    continue
                # Decode positions, one query at a time: each is computed exactly as
                # plain decoding computes it (a verify pass's position included).
                for i in range(offset, offset + n):
                    end = start + i - offset + 1
                    outputs.append(
                        F.scaled_dot_product_attention(
                            queries[:, :, i : i + 1],
                            buffer[None, 0, :, :end],
                            buffer[None, 1, :, :end],
                            scale=self._scale,
                            enable_gqa=True,
                        )
                    )
            attn = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)  # [1, heads, T, d]
            x = x + linear(layer.o, attn[0].transpose(0, 1).reshape(tokens, q_width))
            h = F.rms_norm(x, (self.hidden_size,), layer.post_norm, self._eps)
            gate_up = linear(layer.gate_up, h)
            x = x + linear(
                layer.down, F.silu(gate_up[:, : self._intermediate]) * gate_up[:, self._intermediate :]
            )
        rows: list[int] = []
        for i, (_, offset, n, _, _) in zip(order, plan, strict=True):
            rows.extend(range(offset + n - segments[i].logits, offset + n))
        logits = None
        if rows:
            last = F.rms_norm(x[torch.tensor(rows)], (self.hidden_size,), self._norm, self._eps)
            logits = self._head(last)
        for kv, _, n, start, _ in plan:
            kv.length = start + n
        result: list[torch.Tensor | None] = [None] * len(segments)
        row = 0
        for i in order:
            count = segments[i].logits
            if count:
                assert logits is not None
                result[i] = logits[row : row + count]
                row += count
        return result
