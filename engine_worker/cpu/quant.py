"""The CPU engine's weight formats and the products over them: weight-only
quantization of the linear layers (``Quantization``: ``int4`` groups of 32 with a
scale and an offset, Q4_1's block; ``int8`` per row; ``none``), the int8 LM head
(``Int8Head``), and which kernel runs each product (``Kernels``, chosen by measured
speed in ``kernel_choice``). ``engine_worker.cpu.llama`` runs the forward pass over
them; the formats, their accuracy and speed are in ``llama``'s docstring and
``docs/performance.md``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_worker.cpu.kernels import int4, int8_head

_INT4_GROUP = 32  # input weights sharing one scale and offset (Q4_1's block)


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
    - ``layers``, the int4 linear layers: ``vnni`` (``int4.Product``) or ``torch``
      (``_weight_int4pack_mm_for_cpu``); ``torch`` is also the name of torch's
      int8 and float products, the only ones for those quantizations.
    - ``attention``, decode attention: ``llvm`` (``DecodeAttention``, one
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
        if quantization is Quantization.INT4 and int4.available():
            layers = LAYERS_VNNI
        head = HEAD_FLOAT if quantization is Quantization.NONE else HEAD_INT_MM
        float_activations = layers == LAYERS_VNNI or (
            quantization is Quantization.NONE and dtype == torch.float32
        )
        attention = ATTENTION_LLVM if float_activations and int4.available() else ATTENTION_SDPA
        return cls(head, layers, attention)

    def names(self) -> dict[str, str]:
        """``{"head": ..., "layers": ..., "attention": ...}``."""
        return {"head": self.head, "layers": self.layers, "attention": self.attention}


class QuantizedLinear:
    """``y = x @ W.T (+ b)`` for ``x`` ``[tokens, in]`` float32, ``y`` ``[tokens, out]`` float32.

    ``mode`` ``int4``/``int8`` quantize ``weight`` (``[out, in]``) once here;
    shapes the int4 kernel cannot take (``in`` not a multiple of 32) fall back
    to int8. ``none`` keeps ``weight`` in its dtype. With ``dense``, a quantized
    layer also keeps a bfloat16 copy for ``dense_raw`` (prompt chunks).
    ``int4_kernel`` (``Kernels.layers``): ``vnni`` (``int4.Product``, where this
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
        wants_vnni = int4_kernel == LAYERS_VNNI or (int4_kernel is None and int4.available())
        if mode is Quantization.INT4 and wants_vnni and int4.available() and int4.supports(*weight.shape):
            try:
                self._vnni = int4.pack(*_int4_codes(weight.float()))
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
            kernel = int4.Product(self._vnni)  # its result is reused by its next call: see __call__
        elif self._mode is Quantization.INT4:
            group_scales, int4_mm = self._int4_scales, torch._weight_int4pack_mm_for_cpu
            assert group_scales is not None

            def kernel(x: torch.Tensor) -> torch.Tensor:
                return int4_mm(x, weight, _INT4_GROUP, group_scales)

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
    - ``vnni``: ``int8_head.Product``, an LLVM-generated ``vpdpbusd`` kernel
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
        self._vnni: int8_head.Product | None = None
        if kernel == HEAD_VNNI:
            if not int8_head.available():
                raise ValueError("the VNNI head kernel does not run on this CPU or install")
            self._vnni = int8_head.Product(int8_head.pack(codes))
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
