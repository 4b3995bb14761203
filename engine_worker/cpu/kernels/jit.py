"""Kernels compiled at first use by LLVM for the host CPU (llvmlite's wheel carries
it: no compiler on the machine), run on the OpenMP team torch uses (its wheel
bundles libgomp: ``GOMP_parallel``, what GCC emits for ``#pragma omp parallel``).

``ready()`` says whether this CPU and install can run them: llvmlite importable,
AVX-512 with VNNI (``REQUIRED_FEATURES``), GNU OpenMP in torch; ``jit`` compiles IR
text; the helpers write the IR lines every kernel shares (broadcasts, loops over
rows in chunks, the outlined function's prologue, the parallel entry point).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

REQUIRED_FEATURES = ("avx512f", "avx512bw", "avx512vnni")

"""CPU features every kernel needs (AVX-512 with VNNI's ``vpdpbusd``)."""

Fn = Callable[..., None]


def broadcast(name: str, scalar: str, element: str = "float") -> list[str]:
    """IR lines making ``%name`` a ``<16 x element>`` with ``scalar`` in every lane."""
    vector = f"<16 x {element}>"
    return [
        f"  %{name}0 = insertelement {vector} undef, {element} {scalar}, i32 0",
        f"  %{name} = shufflevector {vector} %{name}0, {vector} undef, <16 x i32> zeroinitializer",
    ]


def splat(value: str, n: int) -> str:
    return "<" + ", ".join([value] * n) + ">"


def row_chunks(chunks: tuple[int, ...], body: Callable[[int], list[str]]) -> list[str]:
    """IR lines looping over ``%rows`` rows from ``%entry``: ``body(c)`` (the lines of
    one chunk of ``c`` rows starting at row ``%row{c}``) while ``c`` rows are left,
    for each ``c`` of ``chunks`` in turn (largest first), then a branch to
    ``%exit``, which the caller defines."""
    lines = [f"  br label %loop{chunks[0]}"]
    start = "0, %entry"
    for i, c in enumerate(chunks):
        after = f"loop{chunks[i + 1]}" if i + 1 < len(chunks) else "exit"
        lines += [
            f"loop{c}:",
            f"  %row{c} = phi i64 [{start}], [%row{c}_next, %body{c}]",
            f"  %left{c} = sub i64 %rows, %row{c}",
            f"  %fits{c} = icmp sge i64 %left{c}, {c}",
            f"  br i1 %fits{c}, label %body{c}, label %{after}",
            f"body{c}:",
            *body(c),
            f"  %row{c}_next = add i64 %row{c}, {c}",
            f"  br label %loop{c}",
        ]
        start = f"%row{c}, %loop{c}"
    return lines


def outlined_prologue(struct: str, fields: tuple[str, ...], pointers: int) -> list[str]:
    """IR lines opening an OpenMP outlined function's body: ``%{field}`` loaded
    from the argument block ``%a`` (type ``%{struct}``: ``pointers`` pointers, then
    int64s), and this thread's share of ``%blocks`` output blocks as ``%nb0 ..
    %nb1`` (split evenly between the team's threads)."""
    lines = []
    for i, name in enumerate(fields):
        ty = "ptr" if i < pointers else "i64"
        lines += [
            f"  %{name}p = getelementptr %{struct}, ptr %a, i32 0, i32 {i}",
            f"  %{name} = load {ty}, ptr %{name}p",
        ]
    return [
        *lines,
        "  %tid32 = call i32 @omp_get_thread_num()",
        "  %nt32 = call i32 @omp_get_num_threads()",
        "  %tid = sext i32 %tid32 to i64",
        "  %nt = sext i32 %nt32 to i64",
        "  %lo = mul i64 %blocks, %tid",
        "  %nb0 = udiv i64 %lo, %nt",
        "  %tid1 = add i64 %tid, 1",
        "  %hi = mul i64 %blocks, %tid1",
        "  %nb1 = udiv i64 %hi, %nt",
    ]


def parallel_entry(name: str, outlined: str) -> list[str]:
    """IR lines of ``name(args, threads)``: ``outlined(args)`` on ``threads`` threads
    of the OpenMP team torch uses (``GOMP_parallel``, what GCC emits for ``#pragma
    omp parallel``)."""
    return [
        f"define void @{name}(ptr %a, i32 %threads) #0 {{",
        "entry:",
        f"  call void @GOMP_parallel(ptr @{outlined}, ptr %a, i32 %threads, i32 0)",
        "  ret void",
        "}",
    ]


DECLARATIONS = """
declare void @GOMP_parallel(ptr, ptr, i32, i32)
declare void @llvm.prefetch.p0(ptr, i32, i32, i32)
declare i32 @omp_get_thread_num()
declare i32 @omp_get_num_threads()
declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <64 x i8>, <64 x i8>)
declare <16 x float> @llvm.fabs.v16f32(<16 x float>)
declare <16 x float> @llvm.maxnum.v16f32(<16 x float>, <16 x float>)
declare <16 x float> @llvm.rint.v16f32(<16 x float>)
declare float @llvm.vector.reduce.fmax.v16f32(<16 x float>)
declare i32 @llvm.vector.reduce.add.v16i32(<16 x i32>)
declare float @expf(float)
declare float @llvm.fabs.f32(float)
declare float @llvm.vector.reduce.fadd.v16f32(float, <16 x float>)
"""


def _openmp_symbols() -> dict[str, int] | None:
    """Addresses of the OpenMP runtime's entry points in the library torch loaded
    (its wheel bundles libgomp) and of libm's ``expf``, for the generated code; or
    ``None`` if torch's OpenMP is not GNU's."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if line.count(" ") >= 5 else ""
        if Path(path).name.startswith("libgomp"):
            lib = ctypes.CDLL(path)
            symbols = {
                name: int(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0)
                for name in ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
            }
            symbols["expf"] = int(ctypes.cast(ctypes.CDLL("libm.so.6").expf, ctypes.c_void_p).value or 0)
            return symbols
    return None


def jit(functions: str) -> object:
    """An execution engine holding ``functions`` (IR text, using ``DECLARATIONS``)
    compiled for this CPU. Raises ``RuntimeError`` (llvmlite's for LLVM's errors)."""
    import llvmlite.binding as llvm

    cpu = llvm.get_host_cpu_name()
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=cpu, features=llvm.get_host_cpu_features().flatten(), opt=3
    )
    module = llvm.parse_assembly(DECLARATIONS + functions + f'attributes #0 = {{ "target-cpu"="{cpu}" }}\n')
    module.verify()
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    return engine


@functools.cache
def ready() -> bool:
    """Whether kernels can be compiled and run here (module docstring); registers the
    OpenMP and libm symbols the generated code calls on the first call."""
    try:
        import llvmlite.binding as llvm
    except ImportError:
        return False
    try:
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        features = llvm.get_host_cpu_features()
        symbols = _openmp_symbols()
        if symbols is None or not all(features.get(f, False) for f in REQUIRED_FEATURES):
            return False
        for name, address in symbols.items():
            llvm.add_symbol(name, address)
    except (RuntimeError, OSError) as e:  # llvmlite reports LLVM's errors as RuntimeError
        log.warning("the CPU kernels cannot be compiled here (%s); using torch's", e)
        return False
    return True
