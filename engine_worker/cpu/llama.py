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
  bytes per token. Where the CPU has AVX-512 VNNI (``vnni.available()``), the
  products are ``vnni.Product``: int8 activations in groups of 32 times the
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
machines all of a pass's in one ``vnni.DecodeAttention`` call per layer, each
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

import enum
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine_worker.cpu import vnni, vnni_head
from engine_worker.cpu.kv_cache import SequenceKV

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_INT4_GROUP = 32  # input weights sharing one scale and offset (Q4_1's block)
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


class Quantization(enum.StrEnum):
    """Weight-only quantization of the linear layers (``--quantization``)."""

    INT4 = "int4"
    INT8 = "int8"
    NONE = "none"


HEAD_ONEDNN, HEAD_INT_MM, HEAD_VNNI, HEAD_FLOAT = "onednn", "int_mm", "vnni", "float"
LAYERS_VNNI, LAYERS_TORCH = "vnni", "torch"
ATTENTION_LLVM, ATTENTION_SDPA = "llvm", "sdpa"


@dataclass(frozen=True, slots=True)
class Kernels:
    """Which kernel runs each product that this engine can run more than one way
    (``kernel_choice`` measures them at start; ``--cpu-kernels`` forces them).

    - ``head``, the LM head: ``int_mm``, ``vnni`` or ``onednn`` (``Int8Head``);
      ``float`` with ``--quantization none``.
    - ``layers``, the int4 linear layers: ``vnni`` (``vnni.Product``) or ``torch``
      (``_weight_int4pack_mm_for_cpu``); ``torch`` is also the name of torch's
      int8 and float products, the only ones for those quantizations.
    - ``attention``, decode attention: ``llvm`` (``vnni.DecodeAttention``, one
      call per layer for every decode position; it needs float32 activations,
      so the ``vnni`` layers or unquantized float32 ones) or ``sdpa`` (torch's
      fused kernel, one call per position).
    """

    head: str = HEAD_INT_MM
    layers: str = LAYERS_TORCH
    attention: str = ATTENTION_SDPA

    @classmethod
    def default(cls, quantization: Quantization, dtype: torch.dtype = torch.float32) -> Kernels:
        """What the CPU's flags allow, without measuring: the VNNI layers and LLVM
        attention where they run, ``int_mm`` for the head (never far from the
        fastest; ``onednn`` can be a hundred times slower: ``Int8Head``)."""
        layers = LAYERS_TORCH
        if quantization is Quantization.INT4 and vnni.available():
            layers = LAYERS_VNNI
        head = HEAD_FLOAT if quantization is Quantization.NONE else HEAD_INT_MM
        float_activations = layers == LAYERS_VNNI or (
            quantization is Quantization.NONE and dtype == torch.float32
        )
        attention = ATTENTION_LLVM if float_activations and vnni.available() else ATTENTION_SDPA
        return cls(head, layers, attention)

    def names(self) -> dict[str, str]:
        """``{"head": ..., "layers": ..., "attention": ...}``."""
        return {"head": self.head, "layers": self.layers, "attention": self.attention}


class UnsupportedModel(Exception):
    """The model's architecture is not one ``LlamaRunner`` implements."""


class QuantizedLinear:
    """``y = x @ W.T (+ b)`` for ``x`` ``[tokens, in]`` float32, ``y`` ``[tokens, out]`` float32.

    ``mode`` ``int4``/``int8`` quantize ``weight`` (``[out, in]``) once here;
    shapes the int4 kernel cannot take (``in`` not a multiple of 32) fall back
    to int8. ``none`` keeps ``weight`` in its dtype. With ``dense``, a quantized
    layer also keeps a bfloat16 copy for ``dense_raw`` (prompt chunks).
    ``int4_kernel`` (``Kernels.layers``): ``vnni`` (``vnni.Product``, where this
    CPU runs it and the shape fits; else torch's) or ``torch``; ``None``: ``vnni``
    where available.
    """

    __slots__ = ("_bias", "_dense", "_int4_scales", "_int8_scales", "_mode", "_vnni", "_weight", "raw")

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        mode: Quantization,
        dense: bool = False,
        int4_kernel: str | None = None,
    ) -> None:
        weight = weight.detach()
        in_features = weight.shape[1]
        if mode is Quantization.INT4 and in_features % _INT4_GROUP != 0:
            mode = Quantization.INT8
        self._mode = mode
        self._bias = None if bias is None else bias.detach().float()
        self._int4_scales: torch.Tensor | None = None
        self._int8_scales: torch.Tensor | None = None
        self._vnni: dict[str, torch.Tensor] | None = None
        wants_vnni = int4_kernel == LAYERS_VNNI or (int4_kernel is None and vnni.available())
        if mode is Quantization.INT4 and wants_vnni and vnni.available() and vnni.supports(*weight.shape):
            try:
                self._vnni = vnni.pack(*_int4_codes(weight.float()))
                self._weight = self._vnni["codes"]
            except ValueError:  # weights past float16's range: torch's kernel below
                self._vnni = None
        if mode is Quantization.INT4 and self._vnni is None:
            self._weight, self._int4_scales = _pack_int4(weight.float())
        if mode is Quantization.INT8:
            w = weight.float()
            scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
            self._weight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            self._int8_scales = scales.to(torch.bfloat16)
        if mode is Quantization.NONE:
            self._weight = weight.contiguous()
        self._dense = (
            weight.to(torch.bfloat16).contiguous() if dense and mode is not Quantization.NONE else None
        )
        self.raw = self._bind()

    @property
    def mode(self) -> Quantization:
        return self._mode

    @property
    def kernel(self) -> str:
        """``Kernels.layers``' name of the product this layer runs."""
        return LAYERS_VNNI if self._vnni is not None else LAYERS_TORCH

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors this layer computes with (bias aside: it comes from the model
        unchanged), by name, for ``from_state``; what ``weight_cache`` stores."""
        out = {"weight": self._weight}
        vnni_parts = self._vnni or {}
        for name, tensor in (
            ("int4_scales", self._int4_scales),
            ("int8_scales", self._int8_scales),
            ("vnni_scales", vnni_parts.get("scales")),
            ("vnni_lows", vnni_parts.get("lows")),
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
        self._vnni = None
        if "vnni_scales" in state:
            self._vnni = {"codes": self._weight, "scales": state["vnni_scales"], "lows": state["vnni_lows"]}
        self._dense = state.get("dense")
        self.raw = self._bind()
        return self

    @property
    def input_dtype(self) -> torch.dtype:
        """What ``raw`` takes: float32 for the VNNI kernel (it quantizes the rows
        itself), bfloat16 for torch's quantized kernels, else the weight's dtype."""
        if self._vnni is not None:
            return torch.float32
        return self._weight.dtype if self._mode is Quantization.NONE else torch.bfloat16

    def _bind(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """``raw``: ``x`` ``[tokens, in]`` in ``input_dtype`` -> ``y`` ``[tokens, out]`` in the
        kernel's output dtype (bfloat16 from the quantized kernels, float32 with a bias;
        widening bfloat16 is exact, so adding it to a float32 tensor gives the bits
        the float32 product would). A closure over the kernel and its tensors: a
        decode pass makes 120 of these calls, and the method dispatch, mode tests
        and ``torch.ops`` wrappers they replace cost about a tenth of the pass."""
        weight, bias = self._weight, self._bias
        kernel: Callable[[torch.Tensor], torch.Tensor]
        if self._vnni is not None:
            kernel = vnni.Product(self._vnni)  # its result is reused by its next call: see __call__
        elif self._mode is Quantization.INT4:
            group_scales, int4 = self._int4_scales, torch._weight_int4pack_mm_for_cpu
            assert group_scales is not None

            def kernel(x: torch.Tensor) -> torch.Tensor:
                return int4(x, weight, _INT4_GROUP, group_scales)

        elif self._mode is Quantization.INT8:
            row_scales, int8 = self._int8_scales, torch._weight_int8pack_mm
            assert row_scales is not None

            def kernel(x: torch.Tensor) -> torch.Tensor:
                return int8(x, weight, row_scales)

        else:

            def kernel(x: torch.Tensor) -> torch.Tensor:
                return F.linear(x, weight)

        if bias is None:
            return kernel
        return lambda x: kernel(x).float() + bias

    def dense_raw(self, x: torch.Tensor) -> torch.Tensor:
        """``raw`` from the bfloat16 copy (``dense=True``; ``x`` bfloat16): a GEMM that
        pays off over many rows, where the quantized kernels take about as long per
        row as alone."""
        assert self._dense is not None
        y = F.linear(x.to(torch.bfloat16), self._dense)
        return y if self._bias is None else y.float() + self._bias

    def nbytes(self) -> int:
        """Bytes of weight data read per forward pass."""
        total = self._weight.numel() * self._weight.element_size()
        vnni_parts = self._vnni or {}
        for extra in (
            self._int4_scales,
            self._int8_scales,
            self._bias,
            vnni_parts.get("scales"),
            vnni_parts.get("lows"),
        ):
            if extra is not None:
                total += extra.numel() * extra.element_size()
        return total

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[tokens, in]`` -> a new ``[tokens, out]`` float32 tensor (``raw``'s
        result may be a buffer its next call overwrites)."""
        y = self.raw(x.to(self.input_dtype))
        return y.clone() if y.dtype == torch.float32 else y.float()


class Int8Head:
    """The LM head: ``[tokens, hidden]`` float32 -> ``[tokens, vocab]`` float32 logits.

    Weights int8 with a scale per output channel (the embedded GGUF's embedding
    is Q8_0, ``int8_rows``); activations as two int8 terms per token, ``x ~ s1*q1
    + s2*q2`` (the second quantizes what the first left over: about 14 bits),
    both rows multiplied in one integer product, exact in int32 and VNNI-fast.
    Logits come out in float32: the weight-only int8 kernel returns bfloat16,
    whose 0.125 steps at logit 25 tie SmolLM2's two best first tokens for "What
    is the capital of France?" (0.08 apart in float32), and eight rows cost it
    three times one row where this head takes about 2.7 times.

    The integer product, by ``kernel`` (``Kernels.head``):

    - ``int_mm``: ``torch._int_mm`` on the weights as stored. On the Intel Xeon
      with AMX it reorders the whole 28 MiB weight on every call (a fifth of a
      decode step there, ``docs/performance.md#where-a-decode-step-goes``); on
      an AMD EPYC (Zen 4) 1.0 ms for the two rows of one decode step.
    - ``vnni``: ``vnni_head.Product``, an LLVM-generated ``vpdpbusd`` kernel
      reading each weight byte once for up to 16 activation rows.
    - ``onednn``: oneDNN's product on weights packed once here
      (``onednn::qlinear_pointwise``, unit scales, float32 out). It packs for
      the best ISA oneDNN finds: with AMX a tile layout (``BA16a64b4a``) that
      only AMX reads fast; on a CPU without AMX only oneDNN's reference matmul
      reads it (605 ms for those two rows on the EPYC). Which is faster is
      measured at start (``kernel_choice``), never assumed from CPU flags.

    Both give the same int32 sums where the kernel is exact (``exact_on_probe``:
    a kernel that saturated 16-bit partial sums, as non-VNNI int8 paths can,
    would not be), so the same logits bit for bit. Raises ``ValueError`` for
    ``onednn`` where this torch has no oneDNN int8 product.
    """

    __slots__ = ("_ones", "_packed", "_scales", "_vnni", "_weight_t", "_zeros", "kernel")

    def __init__(self, weight: torch.Tensor, kernel: str = HEAD_INT_MM) -> None:
        codes, scales = int8_rows(weight)
        self._init(codes, scales, kernel)

    @classmethod
    def of_codes(cls, codes: torch.Tensor, scales: torch.Tensor, kernel: str) -> Int8Head:
        """The head over ``int8_rows``' result (several candidates share one quantization)."""
        self = cls.__new__(cls)
        self._init(codes, scales, kernel)
        return self

    def _init(self, codes: torch.Tensor, scales: torch.Tensor, kernel: str) -> None:
        self.kernel = kernel
        self._scales = scales
        vocab = codes.shape[0]
        self._ones = torch.ones(vocab)
        self._zeros = torch.zeros(vocab, dtype=torch.long)
        self._packed: torch.Tensor | None = None
        # [hidden, vocab], a transposed view of [vocab, hidden]: _int_mm's fastest layout
        self._weight_t: torch.Tensor | None = None
        self._vnni: vnni_head.Product | None = None
        if kernel == HEAD_VNNI:
            if not vnni_head.available():
                raise ValueError("the VNNI head kernel does not run on this CPU or install")
            self._vnni = vnni_head.Product(vnni_head.pack(codes))
        elif kernel == HEAD_ONEDNN:
            self._packed = _pack_onednn_int8(codes)
            if self._packed is None:
                raise ValueError("this torch has no oneDNN int8 product (onednn::qlinear_prepack)")
        elif kernel == HEAD_INT_MM:
            self._weight_t = codes.t()
        else:
            raise ValueError(f"no LM head kernel {kernel!r}")

    def exact_on_probe(self, codes: torch.Tensor) -> bool:
        """Whether this head's product equals ``torch._int_mm`` over ``codes`` (the
        weights it was made from) on activations of +-127 everywhere and +-127
        following the sign of the weights' first rows (the largest partial sums a
        kernel can meet), and on random ones (an int32 sum of at most hidden * 127 *
        127 is exact in float32)."""
        hidden = codes.shape[1]
        signs = torch.where(codes[:4] >= 0, 127, -127).to(torch.int8)
        probe = torch.cat(
            (
                torch.full((1, hidden), 127, dtype=torch.int8),
                torch.full((1, hidden), -127, dtype=torch.int8),
                signs,
                -signs,
                torch.randint(-127, 128, (6, hidden), generator=torch.Generator().manual_seed(0)).to(
                    torch.int8
                ),
            )
        )
        try:
            products = self._products(probe)
        except RuntimeError:
            return False
        return torch.equal(products, torch._int_mm(probe, codes.t()).float())

    def nbytes(self) -> int:
        weights = self._packed if self._packed is not None else self._weight_t
        if self._vnni is not None:
            weights = self._vnni.packed
        assert weights is not None
        return weights.numel() + self._scales.numel() * 4

    def _products(self, q: torch.Tensor) -> torch.Tensor:
        """``q`` ``[rows, hidden]`` int8 times the int8 weights: ``[rows, vocab]``
        float32 holding the exact int32 sums."""
        if self._vnni is not None:
            return self._vnni(q)
        if self._packed is not None:
            products: torch.Tensor = torch.ops.onednn.qlinear_pointwise(
                q, 1.0, 0, self._packed, self._ones, self._zeros, None, 1.0, 0, torch.float32, "none", [], ""
            )
            return products
        assert self._weight_t is not None
        return torch._int_mm(q, self._weight_t).float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        high_scale = (x.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-30)
        high = torch.round(x / high_scale)
        rest = x - high * high_scale
        low_scale = (rest.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-30)
        low = torch.round(rest / low_scale)
        products = self._products(torch.cat((high, low)).to(torch.int8))
        return (products[:rows] * high_scale + products[rows:] * low_scale) * self._scales


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` as int8 codes ``[out, in]`` and a float32 scale per
    output row (``w ~ scale * code``, codes -127..127)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    codes = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def _pack_onednn_int8(codes: torch.Tensor) -> torch.Tensor | None:
    """``codes`` ``[out, in]`` int8 packed for oneDNN's int8 product, or ``None``
    where this torch build has no oneDNN (or it refuses the shape)."""
    try:
        packed: torch.Tensor = torch.ops.onednn.qlinear_prepack(codes, None)
    except (RuntimeError, AttributeError, NotImplementedError):  # no such op, or no oneDNN
        return None
    return packed


def _int4_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` float32 as 16 levels per group of 32 inputs (Q4_1's):
    codes ``[out, in]`` int32 0..15, and ``scale`` and ``low`` ``[out, in/32]``
    float32, where a weight is ``scale * code + low``."""
    out_features, in_features = weight.shape
    groups = weight.view(out_features, in_features // _INT4_GROUP, _INT4_GROUP)
    low = groups.amin(dim=-1)
    scale = ((groups.amax(dim=-1) - low) / 15.0).clamp(min=1e-12)
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    return codes.view(out_features, in_features), scale, low


def _pack_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` float32 in torch's int4 kernel's layout: the packed
    codes and ``[in/32, out, 2]`` bfloat16 (scale, offset), where a weight is
    ``(code - 8) * scale + offset``."""
    codes, scale, low = _int4_codes(weight)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_and_offsets = torch.stack([scale, low + 8.0 * scale], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_offsets.to(torch.bfloat16)


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
    ``vnni.DecodeAttention`` reads the buffer itself: ``fused_decode`` false).
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
                and vnni.attention_available(self.head_dim, self.num_heads, self.num_kv_heads)
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
        decode = vnni.DecodeAttention(d, heads, kv_heads, scale, decode_items) if decode_items else None
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
