"""The int4 linear layers' kernel on CPUs with AVX-512 VNNI: 4-bit weights times
8-bit activations in integer dot products, the scheme of llama.cpp's Q4_1 x Q8_1.

``_weight_int4pack_mm_for_cpu`` (torch's int4 kernel) unpacks each weight to
bfloat16 and multiplies in float: with the weights in cache it takes 54 µs for
the embedded model's 3,072 x 576 gate/up product on 2 threads, and twice that
per block of four rows. Here the weights stay integers: activations are
quantized per row to int8 in groups of 32 (a scale per group,
``d = max|x| / 127``), and ``vpdpbusd`` multiplies 64 code/activation pairs and
sums them in fours into int32 in one instruction; each group's integer sum is
then scaled in float32. The same product takes 27 µs on one thread, and the
codes unpacked for one row serve up to eight rows.

Weights are Q4_1's: ``w = scale * code + low``, codes 0..15 per group of 32
inputs, ``scale`` and ``low`` float16 (as the GGUF's Q4_1 blocks hold them). So
one output is
``sum_g d_g * (scale_g * sum_k q_k * code_k) + low_g * (d_g * sum_k q_k)``, with
the activations' codes ``q``, every inner sum exact in int32.

Layouts (``pack``): codes ``[N/16, G, 4, 64]`` uint8, where byte ``4i + t`` of
vector ``p`` holds, for output ``16 nb + i`` of group ``g``, the code of input
``32g + 4p + t`` in its low nibble and of input ``32g + 16 + 4p + t`` in its high
nibble (so that one unpacked vector is the four inputs ``vpdpbusd`` sums per
output lane, for 16 outputs); scales and lows ``[N/16, G, 16]`` float16.

Batch invariance: each row's activations are quantized from that row alone, and
its outputs are computed by the same instructions in the same order whatever
the other rows (rows go through in chunks of 8, 4, 2 and 1 with the same per-row
sequence), so a row's result is bitwise the same alone or batched.

The machine code is generated at first use for the host CPU (``jit``).
``available()`` says whether this CPU and install can run it; ``LlamaRunner``
falls back to torch's kernel otherwise. ``vpdpbusd``: Intel's intrinsics guide, ``_mm512_dpbusd_epi32``
(AVX512_VNNI); LLVM's ``llvm.x86.avx512.vpdpbusd.512``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from engine_worker.cpu.kernels.jit import (
    Fn,
    broadcast,
    jit,
    outlined_prologue,
    parallel_entry,
    ready,
    row_chunks,
    splat,
)

log = logging.getLogger(__name__)

GROUP = 32
"""Inputs per group: one activation scale, one weight scale and low (Q4_1's block)."""
LANES = 16
"""Outputs per vector (16 int32 / float32 lanes of a 512-bit register)."""
CHUNKS = (8, 4, 2, 1)
"""Rows per call of the product, largest first: the codes unpacked once serve them all."""

LAYOUT = "q4_1-f16-lanes16"
"""``pack``'s layout, in the weight cache's fingerprint: change it with the layout,
so that a file in another one is never read back."""

PREFETCH_BYTES = 4096
PREFETCH_LOCALITY = 3
"""How far ahead of the codes being multiplied the kernel asks for the next ones
(16 groups ahead, all four cache lines of one, into every cache level:
``PREFETCH_LOCALITY`` 3). Over 120 distinct 3,072 x 576 weights cycled (out of
cache, as in a pass), 0 / 512 / 1,024 / 4,096 bytes took 98 / 85 / 87 / 84 µs a
product for one row and 142 / 135 / 119 / 111 µs for eight; locality 0 (past
the caches) 112-117 and 144-254 µs."""


def _quantize_ir() -> str:
    """``quantize(x, rows, k, xq, xd, xs)``: per row and group of 32 float32 inputs,
    ``d = max|x| / 127`` (0 for an all-zero group), ``q = rint(x * (127 / max|x|))``
    as int8, and ``d * sum(q)`` (the low term's factor)."""
    return """
define void @quantize(ptr noalias %x, i64 %rows, i64 %k,
                      ptr noalias %xq, ptr noalias %xd, ptr noalias %xs) #0 {
entry:
  %groups = udiv i64 %k, 32
  %total = mul i64 %rows, %groups
  %empty = icmp eq i64 %total, 0
  br i1 %empty, label %exit, label %loop
loop:
  %i = phi i64 [0, %entry], [%next, %loop]
  %off = mul i64 %i, 32
  %p = getelementptr float, ptr %x, i64 %off
  %p1 = getelementptr float, ptr %p, i64 16
  %a = load <16 x float>, ptr %p, align 4
  %b = load <16 x float>, ptr %p1, align 4
  %aa = call <16 x float> @llvm.fabs.v16f32(<16 x float> %a)
  %ba = call <16 x float> @llvm.fabs.v16f32(<16 x float> %b)
  %m = call <16 x float> @llvm.maxnum.v16f32(<16 x float> %aa, <16 x float> %ba)
  %amax = call float @llvm.vector.reduce.fmax.v16f32(<16 x float> %m)
  %pos = fcmp ogt float %amax, 0.0
  %inv0 = fdiv float 127.0, %amax
  %inv = select i1 %pos, float %inv0, float 0.0
  %d = fdiv float %amax, 127.0
  %vi0 = insertelement <16 x float> undef, float %inv, i32 0
  %vi = shufflevector <16 x float> %vi0, <16 x float> undef, <16 x i32> zeroinitializer
  %sa = fmul <16 x float> %a, %vi
  %sb = fmul <16 x float> %b, %vi
  %ra = call <16 x float> @llvm.rint.v16f32(<16 x float> %sa)
  %rb = call <16 x float> @llvm.rint.v16f32(<16 x float> %sb)
  %ia = fptosi <16 x float> %ra to <16 x i32>
  %ib = fptosi <16 x float> %rb to <16 x i32>
  %qa = trunc <16 x i32> %ia to <16 x i8>
  %qb = trunc <16 x i32> %ib to <16 x i8>
  %qp = getelementptr i8, ptr %xq, i64 %off
  %qp1 = getelementptr i8, ptr %qp, i64 16
  store <16 x i8> %qa, ptr %qp, align 1
  store <16 x i8> %qb, ptr %qp1, align 1
  %sab = add <16 x i32> %ia, %ib
  %sum = call i32 @llvm.vector.reduce.add.v16i32(<16 x i32> %sab)
  %sumf = sitofp i32 %sum to float
  %low = fmul float %d, %sumf
  %dp = getelementptr float, ptr %xd, i64 %i
  store float %d, ptr %dp, align 4
  %sp = getelementptr float, ptr %xs, i64 %i
  store float %low, ptr %sp, align 4
  %next = add i64 %i, 1
  %done = icmp eq i64 %next, %total
  br i1 %done, label %exit, label %loop
exit:
  ret void
}
"""


def _gemm_ir(rows: int) -> str:
    """``gemm{rows}(codes, scales, lows, xq, xd, xs, y, nb0, nb1, groups, k, n)``:
    outputs ``16 nb0 .. 16 nb1`` of ``rows`` consecutive rows (``xq`` ``[rows, k]``,
    ``xd``/``xs`` ``[rows, groups]``, ``y`` ``[rows, n]``)."""
    m15, s4 = splat("i8 15", 64), splat("i8 4", 64)
    head = [
        f"define void @gemm{rows}(ptr noalias %codes, ptr noalias %scales, ptr noalias %lows, "
        "ptr noalias %xq, ptr noalias %xd, ptr noalias %xs, ptr noalias %y, "
        "i64 %nb0, i64 %nb1, i64 %groups, i64 %k, i64 %n) #0 {",
        "entry:",
        "  %none = icmp sge i64 %nb0, %nb1",
        "  br i1 %none, label %exit, label %block",
        "block:",
        "  %nb = phi i64 [%nb0, %entry], [%nb_next, %block_end]",
        "  br label %group",
        "group:",
        "  %g = phi i64 [0, %block], [%g_next, %group]",
    ]
    body = [
        f"  %acc{r} = phi <16 x float> [zeroinitializer, %block], [%acc{r}_next, %group]" for r in range(rows)
    ]
    body += [
        "  %bg0 = mul i64 %nb, %groups",
        "  %bg = add i64 %bg0, %g",
        "  %coff = mul i64 %bg, 256",
        "  %cp = getelementptr i8, ptr %codes, i64 %coff",
    ]
    if PREFETCH_BYTES:
        for line in range(4):
            body += [
                f"  %pfc{line} = getelementptr i8, ptr %cp, i64 {PREFETCH_BYTES + 64 * line}",
                f"  call void @llvm.prefetch.p0(ptr %pfc{line}, i32 0, i32 {PREFETCH_LOCALITY}, i32 1)",
            ]
    for p in range(4):
        body += [
            f"  %pp{p} = getelementptr <64 x i8>, ptr %cp, i64 {p}",
            f"  %pk{p} = load <64 x i8>, ptr %pp{p}, align 64",
            f"  %c{p} = and <64 x i8> %pk{p}, {m15}",
            f"  %c{p + 4} = lshr <64 x i8> %pk{p}, {s4}",
        ]
    body += [
        "  %so = mul i64 %bg, 16",
        "  %sp = getelementptr half, ptr %scales, i64 %so",
        "  %sh = load <16 x half>, ptr %sp, align 32",
        "  %sv = fpext <16 x half> %sh to <16 x float>",
        "  %lp = getelementptr half, ptr %lows, i64 %so",
        "  %lh = load <16 x half>, ptr %lp, align 32",
        "  %lv = fpext <16 x half> %lh to <16 x float>",
        "  %xg = mul i64 %g, 8",
    ]
    for r in range(rows):
        body += [
            f"  %xrow{r} = mul i64 %k, {r}",
            f"  %xqr{r} = getelementptr i8, ptr %xq, i64 %xrow{r}",
            f"  %grow{r}a = mul i64 %groups, {r}",
            f"  %grow{r} = add i64 %grow{r}a, %g",
            f"  %dp{r} = getelementptr float, ptr %xd, i64 %grow{r}",
            f"  %d{r} = load float, ptr %dp{r}, align 4",
            f"  %lsp{r} = getelementptr float, ptr %xs, i64 %grow{r}",
            f"  %ls{r} = load float, ptr %lsp{r}, align 4",
        ]
        prev = "zeroinitializer"
        for q in range(8):
            body += [
                f"  %xo{r}_{q} = add i64 %xg, {q}",
                f"  %xp{r}_{q} = getelementptr i32, ptr %xqr{r}, i64 %xo{r}_{q}",
                f"  %xv{r}_{q} = load i32, ptr %xp{r}_{q}, align 1",
                *broadcast(f"xb{r}_{q}", f"%xv{r}_{q}", "i32"),
                f"  %xc{r}_{q} = bitcast <16 x i32> %xb{r}_{q} to <64 x i8>",
                f"  %s{r}_{q} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> {prev}, "
                f"<64 x i8> %c{q}, <64 x i8> %xc{r}_{q})",
            ]
            prev = f"%s{r}_{q}"
        body += [
            f"  %f{r} = sitofp <16 x i32> {prev} to <16 x float>",
            *broadcast(f"dv{r}", f"%d{r}"),
            *broadcast(f"lsv{r}", f"%ls{r}"),
            f"  %t{r}a = fmul <16 x float> %f{r}, %sv",
            f"  %t{r}b = fmul <16 x float> %t{r}a, %dv{r}",
            f"  %t{r}c = fmul <16 x float> %lv, %lsv{r}",
            f"  %t{r}d = fadd <16 x float> %t{r}b, %t{r}c",
            f"  %acc{r}_next = fadd <16 x float> %acc{r}, %t{r}d",
        ]
    body += [
        "  %g_next = add i64 %g, 1",
        "  %g_done = icmp eq i64 %g_next, %groups",
        "  br i1 %g_done, label %block_end, label %group",
        "block_end:",
        "  %yo = mul i64 %nb, 16",
    ]
    for r in range(rows):
        body += [
            f"  %yrow{r} = mul i64 %n, {r}",
            f"  %yoff{r} = add i64 %yrow{r}, %yo",
            f"  %yp{r} = getelementptr float, ptr %y, i64 %yoff{r}",
            f"  store <16 x float> %acc{r}_next, ptr %yp{r}, align 4",
        ]
    body += [
        "  %nb_next = add i64 %nb, 1",
        "  %nb_done = icmp sge i64 %nb_next, %nb1",
        "  br i1 %nb_done, label %exit, label %block",
        "exit:",
        "  ret void",
        "}",
    ]
    return "\n".join(head + body) + "\n"


def _run_rows_ir() -> str:
    """``run_rows(codes, scales, lows, xq, xd, xs, y, nb0, nb1, groups, k, n, rows)``:
    output blocks ``nb0 .. nb1`` of all ``rows``, through ``gemm8`` while 8 rows
    are left, then ``gemm4``, ``gemm2``, ``gemm1``."""

    def chunk(c: int) -> list[str]:
        return [
            f"  %xqo{c} = mul i64 %row{c}, %k",
            f"  %xqp{c} = getelementptr i8, ptr %xq, i64 %xqo{c}",
            f"  %xgo{c} = mul i64 %row{c}, %groups",
            f"  %xdp{c} = getelementptr float, ptr %xd, i64 %xgo{c}",
            f"  %xsp{c} = getelementptr float, ptr %xs, i64 %xgo{c}",
            f"  %yo{c} = mul i64 %row{c}, %n",
            f"  %yp{c} = getelementptr float, ptr %y, i64 %yo{c}",
            f"  call void @gemm{c}(ptr %codes, ptr %scales, ptr %lows, ptr %xqp{c}, ptr %xdp{c}, "
            f"ptr %xsp{c}, ptr %yp{c}, i64 %nb0, i64 %nb1, i64 %groups, i64 %k, i64 %n)",
        ]

    lines = [
        "define void @run_rows(ptr %codes, ptr %scales, ptr %lows, ptr %xq, ptr %xd, ptr %xs, ptr %y, "
        "i64 %nb0, i64 %nb1, i64 %groups, i64 %k, i64 %n, i64 %rows) #0 {",
        "entry:",
        *row_chunks(CHUNKS, chunk),
        "exit:",
        "  ret void",
        "}",
    ]
    return "\n".join(lines) + "\n"


ARG_FIELDS = ("codes", "scales", "lows", "xq", "xd", "xs", "y", "blocks", "groups", "k", "n", "rows")
"""``linear``'s argument block: 7 pointers, then 5 int64."""


def _parallel_ir() -> str:
    """``linear(args, threads)``: ``run_rows`` over the output blocks split evenly
    between ``threads`` threads of the OpenMP team torch uses (``parallel_entry``),
    so the kernel shares torch's thread pool rather than competing with it for the
    cores."""
    lines = [
        f"%args = type {{ {', '.join(['ptr'] * 7 + ['i64'] * 5)} }}",
        "define void @outlined(ptr %a) #0 {",
        "entry:",
        *outlined_prologue("args", ARG_FIELDS, 7),
        "  call void @run_rows(ptr %codes, ptr %scales, ptr %lows, ptr %xq, ptr %xd, ptr %xs, ptr %y, "
        "i64 %nb0, i64 %nb1, i64 %groups, i64 %k, i64 %n, i64 %rows)",
        "  ret void",
        "}",
        *parallel_entry("linear", "outlined"),
    ]
    return "\n".join(lines) + "\n"


class _Args(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ARG_FIELDS[:7]] + [
        (name, ctypes.c_int64) for name in ARG_FIELDS[7:]
    ]


@dataclass(frozen=True, slots=True)
class _Compiled:
    engine: object  # keeps the machine code alive
    quantize: Fn
    linear: Fn


@functools.cache
def _compiled() -> _Compiled | None:
    """The kernels compiled for this CPU, or ``None`` where it or the install cannot
    run them (``jit.ready``)."""
    if not ready():
        return None
    try:
        engine: Any = jit(
            _quantize_ir() + "".join(_gemm_ir(r) for r in CHUNKS) + _run_rows_ir() + _parallel_ir()
        )
    except RuntimeError as e:  # llvmlite reports LLVM's errors as RuntimeError
        log.warning("the VNNI int4 kernel could not be compiled (%s); using torch's", e)
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    quantize = ctypes.CFUNCTYPE(None, p, i64, i64, p, p, p)(engine.get_function_address("quantize"))
    linear = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Args), ctypes.c_int32)(
        engine.get_function_address("linear")
    )
    return _Compiled(engine, quantize, linear)


def available() -> bool:
    """Whether this CPU and install run the kernel (compiles it on first call, ~0.2 s)."""
    return _compiled() is not None


def supports(out_features: int, in_features: int) -> bool:
    """Whether a ``[out, in]`` weight fits the kernel's layout."""
    return out_features % LANES == 0 and in_features % GROUP == 0


def pack(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> dict[str, torch.Tensor]:
    """``codes`` ``[N, K]`` integers 0..15, ``scale`` and ``low`` ``[N, K/32]`` float32
    (``w = scale * code + low``) in the kernel's layout: ``codes`` ``[N/16, G, 4, 64]``
    uint8, ``scales`` and ``lows`` ``[N/16, G, 16]`` float16. Raises ``ValueError``
    for a shape ``supports`` refuses, or a scale or low past float16's range."""
    n, k = codes.shape
    if not supports(n, k):
        raise ValueError(f"a {n} x {k} weight does not fit the VNNI kernel")
    g = k // GROUP
    c = codes.to(torch.uint8).reshape(n // LANES, LANES, g, 8, 4).permute(0, 2, 3, 1, 4)
    packed = (c[:, :, :4] | (c[:, :, 4:] << 4)).reshape(n // LANES, g, 4, 64).contiguous()

    def lanes(t: torch.Tensor) -> torch.Tensor:
        half = t.to(torch.float16)
        if not torch.isfinite(half).all():
            raise ValueError("a scale or low is past float16's range")
        return half.reshape(n // LANES, LANES, g).permute(0, 2, 1).contiguous()

    return {"codes": packed, "scales": lanes(scale), "lows": lanes(low)}


class _Scratch(threading.local):
    """The activations' int8 copy, their group scales and a product's result, shared
    by every ``Product`` of a thread (a pass runs its products one after another,
    and each result is consumed before the next product): their size is the
    largest product a pass has made, not one buffer per layer and row count."""

    def __init__(self) -> None:
        self.codes = torch.empty(0, dtype=torch.int8)
        self.floats = torch.empty(0)
        self.out = torch.empty(0)
        self.generation = 0

    def fit(self, codes: int, floats: int, out: int) -> None:
        """Grow the buffers to hold these many elements (each at least 1.5x when it grows)."""
        grown = False
        if self.codes.numel() < codes:
            self.codes, grown = torch.empty(max(codes, self.codes.numel() * 3 // 2), dtype=torch.int8), True
        if self.floats.numel() < floats:
            self.floats, grown = torch.empty(max(floats, self.floats.numel() * 3 // 2)), True
        if self.out.numel() < out:
            self.out, grown = torch.empty(max(out, self.out.numel() * 3 // 2)), True
        self.generation += grown


_SCRATCH = _Scratch()


class Product:
    """``y = x @ W.T`` for one packed weight (``pack``): ``x`` ``[rows, K]`` float32,
    ``y`` ``[rows, N]`` float32, on ``torch.get_num_threads()`` threads of torch's
    OpenMP team. ``available()`` must be true.

    Without ``out``, the result is a view of a buffer every ``Product`` of the
    thread shares (``_Scratch``): valid until the thread's next product."""

    __slots__ = ("_args", "_compiled", "_key", "_view", "blocks", "groups", "weights")

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        compiled = _compiled()
        assert compiled is not None
        self._compiled = compiled
        self.weights = weights  # kept alive: _args holds their addresses
        self.blocks, self.groups = int(weights["codes"].shape[0]), int(weights["codes"].shape[1])
        w = weights
        self._args = _Args(w["codes"].data_ptr(), w["scales"].data_ptr(), w["lows"].data_ptr())
        self._args.blocks, self._args.groups = self.blocks, self.groups
        self._args.k, self._args.n = self.groups * GROUP, self.blocks * LANES
        self._key = (-1, -1)  # (rows, scratch generation) the pointers in _args are for
        self._view = torch.empty(0)  # the shared result buffer as [rows, N], for that key

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        args, scratch = self._args, _SCRATCH
        k, n, groups = args.k, args.n, self.groups
        if not x.is_contiguous():
            x = x.contiguous()
        if self._key != (rows, scratch.generation):
            scratch.fit(rows * k, 2 * rows * groups, rows * n)
            floats = scratch.floats.data_ptr()
            args.xq, args.xd, args.xs = scratch.codes.data_ptr(), floats, floats + rows * groups * 4
            args.rows = rows
            self._key = (rows, scratch.generation)
            self._view = scratch.out[: rows * n].view(rows, n)
        compiled = self._compiled
        compiled.quantize(x.data_ptr(), rows, k, args.xq, args.xd, args.xs)
        if out is None:
            out = self._view
        args.y = out.data_ptr()
        compiled.linear(ctypes.byref(args), min(torch.get_num_threads(), self.blocks))
        return out
