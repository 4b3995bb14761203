"""Decode attention on CPU: one query per sequence of a pass attending over its own
KV, every sequence of the pass in one call per layer, with a running maximum (the
online softmax) over the positions; each (sequence, KV head) unit's arithmetic is
the same whatever the others, so a row's result is bitwise the same alone or batched.
Compiled per attention shape at first use (``jit``); ``attention_available`` says
whether it runs here for a shape, else ``LlamaRunner`` uses torch's SDPA.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import torch

from engine_worker.cpu.kernels.int4 import LANES
from engine_worker.cpu.kernels.jit import Fn, broadcast, jit, ready

log = logging.getLogger(__name__)


ITEM_FIELDS = ("q", "kv", "out", "capacity", "length")
"""An ``Attention`` item: one decode query (a row of the pass) and its sequence's KV."""


class _Item(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ITEM_FIELDS[:3]] + [
        (name, ctypes.c_int64) for name in ITEM_FIELDS[3:]
    ]


def _attention_ir(head_dim: int, group: int, kv_heads: int) -> str:
    """``attend(items, count, layer, scale, threads)``: for every item and KV head, the
    ``group`` query heads that share it attend over the item's ``length`` positions
    (keys and values of ``layer`` in the item's ``[layers, 2, kv_heads, capacity,
    head_dim]`` float32 buffer), one pass over the positions with a running
    maximum (the online softmax), ``out = sum_l exp(s_l - max) v_l / sum_l exp(s_l -
    max)``, ``s_l = scale * q . k_l``. Work units (item, KV head) are split
    between the threads; each unit's arithmetic is the same whatever the others."""
    vecs = head_dim // LANES
    lines = [
        "define void @attend_unit(ptr %q, ptr %k, ptr %v, i64 %length, ptr %out, float %scale) #0 {",
        "entry:",
    ]
    for g in range(group):
        for j in range(vecs):
            lines += [
                f"  %qp{g}_{j} = getelementptr float, ptr %q, i64 {g * head_dim + j * LANES}",
                f"  %q{g}_{j} = load <16 x float>, ptr %qp{g}_{j}, align 4",
            ]
    lines += ["  %empty = icmp eq i64 %length, 0", "  br i1 %empty, label %exit, label %loop", "loop:"]
    lines += ["  %l = phi i64 [0, %entry], [%l_next, %loop]"]
    for g in range(group):
        lines += [
            f"  %m{g} = phi float [0xFFF0000000000000, %entry], [%m{g}_next, %loop]",
            f"  %s{g} = phi float [0.0, %entry], [%s{g}_next, %loop]",
        ]
        for j in range(vecs):
            lines += [f"  %a{g}_{j} = phi <16 x float> [zeroinitializer, %entry], [%a{g}_{j}_next, %loop]"]
    lines += [
        f"  %row = mul i64 %l, {head_dim}",
        "  %kp = getelementptr float, ptr %k, i64 %row",
        "  %vp = getelementptr float, ptr %v, i64 %row",
    ]
    for j in range(vecs):
        lines += [
            f"  %kp{j} = getelementptr float, ptr %kp, i64 {j * LANES}",
            f"  %k{j} = load <16 x float>, ptr %kp{j}, align 4",
            f"  %vp{j} = getelementptr float, ptr %vp, i64 {j * LANES}",
            f"  %v{j} = load <16 x float>, ptr %vp{j}, align 4",
        ]
    for g in range(group):
        prod = f"%d{g}_0"
        lines += [f"  %d{g}_0 = fmul <16 x float> %q{g}_0, %k0"]
        for j in range(1, vecs):
            lines += [
                f"  %e{g}_{j} = fmul <16 x float> %q{g}_{j}, %k{j}",
                f"  %d{g}_{j} = fadd <16 x float> %d{g}_{j - 1}, %e{g}_{j}",
            ]
            prod = f"%d{g}_{j}"
        lines += [
            f"  %dot{g} = call reassoc float @llvm.vector.reduce.fadd.v16f32(float 0.0, <16 x float> {prod})",
            f"  %sc{g} = fmul float %dot{g}, %scale",
            f"  %up{g} = fcmp ogt float %sc{g}, %m{g}",
            f"  %df{g} = fsub float %sc{g}, %m{g}",
            f"  %ad{g} = call float @llvm.fabs.f32(float %df{g})",
            f"  %nd{g} = fneg float %ad{g}",
            f"  %ex{g} = call float @expf(float %nd{g})",
            f"  %corr{g} = select i1 %up{g}, float %ex{g}, float 1.0",
            f"  %p{g} = select i1 %up{g}, float 1.0, float %ex{g}",
            f"  %m{g}_next = select i1 %up{g}, float %sc{g}, float %m{g}",
            f"  %sm{g} = fmul float %s{g}, %corr{g}",
            f"  %s{g}_next = fadd float %sm{g}, %p{g}",
            *broadcast(f"cv{g}", f"%corr{g}"),
            *broadcast(f"pv{g}", f"%p{g}"),
        ]
        for j in range(vecs):
            lines += [
                f"  %am{g}_{j} = fmul <16 x float> %a{g}_{j}, %cv{g}",
                f"  %pw{g}_{j} = fmul <16 x float> %pv{g}, %v{j}",
                f"  %a{g}_{j}_next = fadd <16 x float> %am{g}_{j}, %pw{g}_{j}",
            ]
    lines += [
        "  %l_next = add i64 %l, 1",
        "  %l_done = icmp eq i64 %l_next, %length",
        "  br i1 %l_done, label %store, label %loop",
        "store:",
    ]
    for g in range(group):
        lines += broadcast(f"iv{g}", f"%s{g}_next")
        for j in range(vecs):
            lines += [
                f"  %o{g}_{j} = fdiv <16 x float> %a{g}_{j}_next, %iv{g}",
                f"  %op{g}_{j} = getelementptr float, ptr %out, i64 {g * head_dim + j * LANES}",
                f"  store <16 x float> %o{g}_{j}, ptr %op{g}_{j}, align 4",
            ]
    lines += ["  br label %exit", "exit:", "  ret void", "}"]
    fields = ", ".join(["ptr"] * 3 + ["i64"] * 2)
    lines += [
        f"%item = type {{ {fields} }}",
        "%job = type { ptr, i64, i64, float }",
        "define void @attend_outlined(ptr %job) #0 {",
        "entry:",
        "  %itp = getelementptr %job, ptr %job, i32 0, i32 0",
        "  %items = load ptr, ptr %itp",
        "  %cp = getelementptr %job, ptr %job, i32 0, i32 1",
        "  %count = load i64, ptr %cp",
        "  %lp = getelementptr %job, ptr %job, i32 0, i32 2",
        "  %layer = load i64, ptr %lp",
        "  %sp = getelementptr %job, ptr %job, i32 0, i32 3",
        "  %scale = load float, ptr %sp",
        "  %tid32 = call i32 @omp_get_thread_num()",
        "  %nt32 = call i32 @omp_get_num_threads()",
        "  %tid = sext i32 %tid32 to i64",
        "  %nt = sext i32 %nt32 to i64",
        f"  %units = mul i64 %count, {kv_heads}",
        "  %lo = mul i64 %units, %tid",
        "  %u0 = udiv i64 %lo, %nt",
        "  %tid1 = add i64 %tid, 1",
        "  %hi = mul i64 %units, %tid1",
        "  %u1 = udiv i64 %hi, %nt",
        "  %none = icmp sge i64 %u0, %u1",
        "  br i1 %none, label %exit, label %unit",
        "unit:",
        "  %u = phi i64 [%u0, %entry], [%u_next, %unit]",
        f"  %i = udiv i64 %u, {kv_heads}",
        f"  %h = urem i64 %u, {kv_heads}",
        "  %ip = getelementptr %item, ptr %items, i64 %i",
        "  %qfp = getelementptr %item, ptr %ip, i32 0, i32 0",
        "  %qb = load ptr, ptr %qfp",
        "  %kvfp = getelementptr %item, ptr %ip, i32 0, i32 1",
        "  %kvb = load ptr, ptr %kvfp",
        "  %ofp = getelementptr %item, ptr %ip, i32 0, i32 2",
        "  %ob = load ptr, ptr %ofp",
        "  %capfp = getelementptr %item, ptr %ip, i32 0, i32 3",
        "  %cap = load i64, ptr %capfp",
        "  %lenfp = getelementptr %item, ptr %ip, i32 0, i32 4",
        "  %len = load i64, ptr %lenfp",
        f"  %headsz = mul i64 %cap, {head_dim}",
        f"  %l2 = mul i64 %layer, {2 * kv_heads}",
        "  %kplane = add i64 %l2, %h",
        f"  %vplane = add i64 %kplane, {kv_heads}",
        "  %koff = mul i64 %kplane, %headsz",
        "  %voff = mul i64 %vplane, %headsz",
        "  %kh = getelementptr float, ptr %kvb, i64 %koff",
        "  %vh = getelementptr float, ptr %kvb, i64 %voff",
        f"  %qoff = mul i64 %h, {group * head_dim}",
        "  %qh = getelementptr float, ptr %qb, i64 %qoff",
        "  %oh = getelementptr float, ptr %ob, i64 %qoff",
        "  call void @attend_unit(ptr %qh, ptr %kh, ptr %vh, i64 %len, ptr %oh, float %scale)",
        "  %u_next = add i64 %u, 1",
        "  %u_done = icmp sge i64 %u_next, %u1",
        "  br i1 %u_done, label %exit, label %unit",
        "exit:",
        "  ret void",
        "}",
        "define void @attend(ptr %job, i32 %threads) #0 {",
        "entry:",
        "  call void @GOMP_parallel(ptr @attend_outlined, ptr %job, i32 %threads, i32 0)",
        "  ret void",
        "}",
    ]
    return "\n".join(lines) + "\n"


class _Job(ctypes.Structure):
    _fields_ = [
        ("items", ctypes.c_void_p),
        ("count", ctypes.c_int64),
        ("layer", ctypes.c_int64),
        ("scale", ctypes.c_float),
    ]


@functools.cache
def _attention(head_dim: int, group: int, kv_heads: int) -> tuple[object, Fn] | None:
    """The decode attention kernel for this shape (compiled on first use), or
    ``None`` where the kernels are unavailable or the head does not fill whole
    vectors."""
    if not ready() or head_dim % LANES or head_dim > 256:
        return None
    try:
        engine: Any = jit(_attention_ir(head_dim, group, kv_heads))
    except RuntimeError as e:
        log.warning("the decode attention kernel could not be compiled (%s); using torch's", e)
        return None
    fn = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Job), ctypes.c_int32)(engine.get_function_address("attend"))
    return engine, fn


def attention_available(head_dim: int, heads: int, kv_heads: int) -> bool:
    """Whether ``DecodeAttention`` runs for this attention shape on this machine."""
    return heads % kv_heads == 0 and _attention(head_dim, heads // kv_heads, kv_heads) is not None


class DecodeAttention:
    """One query per item attending over its sequence's KV, all items of a pass in
    one call per layer, on ``torch.get_num_threads()`` threads.

    ``items``: per query ``(q, kv, out, length)``: ``q`` a ``[heads, head_dim]``
    float32 view (the rotated queries of one row), ``kv`` the sequence's whole
    ``[layers, 2, kv_heads, capacity, head_dim]`` float32 buffer, ``out`` a
    ``[heads, head_dim]`` float32 view it writes, ``length`` the positions it
    attends to (the query's own included). Query head ``j`` reads KV head ``j //
    (heads / kv_heads)``, as grouped-query attention does. ``attention_available``
    must be true. The views must outlive the calls."""

    __slots__ = ("_fn", "_items", "_job", "_keep")

    def __init__(
        self,
        head_dim: int,
        heads: int,
        kv_heads: int,
        scale: float,
        items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
    ) -> None:
        compiled = _attention(head_dim, heads // kv_heads, kv_heads)
        assert compiled is not None
        self._fn = compiled[1]
        self._items = (_Item * len(items))(
            *(
                _Item(q.data_ptr(), kv.data_ptr(), out.data_ptr(), kv.shape[3], length)
                for q, kv, out, length in items
            )
        )
        self._keep = items
        self._job = _Job(ctypes.addressof(self._items), len(items), 0, scale)

    def __call__(self, layer: int) -> None:
        self._job.layer = layer
        self._fn(ctypes.byref(self._job), min(torch.get_num_threads(), max(1, len(self._keep))))
