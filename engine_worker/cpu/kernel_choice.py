"""Which kernel runs each of the CPU engine's products, chosen at start by measured
speed on the model's own shapes, never by CPU flags alone.

Three products can run more than one way (``llama.Kernels``): the LM head
(``torch._int_mm``, the LLVM-generated VNNI kernel of ``kernels.int8_head``, or oneDNN's
packed int8 product), the int4 linear layers (the VNNI kernel of ``kernels.int4`` or
torch's int4 kernel) and decode attention (one LLVM-generated call per layer, or
torch's fused kernel per position). Flags do not say which is faster: oneDNN
packs the head for AMX where a CPU has it, and on an AMD EPYC (Zen 4) without AMX
the packed product runs oneDNN's reference matmul, 600 ms for one decode step's
two rows against 2.0 ms for ``torch._int_mm`` and 0.36 ms for the VNNI head.

For each product with more than one candidate this machine can run, ``resolve``
times every candidate on the model's shapes at ``ROWS`` rows (``time_call``: a
warm-up call, then ``BUDGET_S`` of calls, the least), keeps the one with the
least total (``pick``), provided it is exact on a probe (the head: the same int32
sums as ``torch._int_mm``; the layers: each row bitwise the same alone as in a
batch of 8, and within 10% of the float32 product; attention: within 1e-4 of a
float64 reference, and bitwise alone as batched); a candidate that is not exact
gives way to the next. A candidate whose warm-up call takes ``SLOW`` times the
best 1-row time so far (and over ``GIVE_UP_FLOOR_S``) is not timed further. The
layers are timed on the first decoder layer's four products with their weights
in cache (a pass reads 30 layers' from memory), attention over ``CONTEXT``
positions. On the embedded model all of it takes about 1.2 s, most of it
oneDNN's one warm-up call where that is the reference matmul.

The choice is kept in ``cache_dir/kernels/<key>.json``, the key a digest of what
it depends on: the CPU's model name and flags, the thread count, torch's
version, oneDNN's ISA cap variables, whether the LLVM kernels compile here, the
model's shapes and the quantization (``fingerprint``). A later start reads it and
measures nothing (nor does a process building the same shapes again:
``_MEASURED``). ``--cpu-kernels head=int_mm,layers=torch,attention=sdpa`` (any
subset) forces a kernel for diagnosis: refused at start where it cannot run here
or is not exact; the others are read back or measured.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine_worker.cpu.kernels import int4
from engine_worker.cpu.kernels.attention import DecodeAttention, attention_available
from engine_worker.cpu.quant import (
    ATTENTION_LLVM,
    ATTENTION_SDPA,
    HEAD_FLOAT,
    HEAD_INT_MM,
    HEAD_ONEDNN,
    HEAD_VNNI,
    LAYERS_TORCH,
    LAYERS_VNNI,
    Int8Head,
    Kernels,
    Quantization,
    QuantizedLinear,
    int8_rows,
)
from engine_worker.settings import parse_cpu_kernels

log = logging.getLogger(__name__)

FORMAT = 1
"""Bump when what a cached choice means changes (a candidate renamed, another timing)."""
ROWS = (1, 8)
"""Rows each candidate is timed at: one decode step alone, and eight sequences at once."""
BUDGET_S = 0.01
"""Seconds of calls per candidate and row count (after one warm-up call)."""
SLOW = 20.0
"""A candidate whose 1-row call takes this many times the best one so far is not
timed at 8 rows (oneDNN's reference matmul: a second per call)."""
GIVE_UP_FLOOR_S = 0.05
"""A warm-up call is cut short (``SLOW``) only past this too: a first call may set
things up (torch's first fused attention call takes milliseconds)."""
CONTEXT = 256
"""Positions each decode query attends over when attention is timed."""

ROLES = ("head", "layers", "attention")
CANDIDATES: dict[str, tuple[str, ...]] = {
    "head": (HEAD_INT_MM, HEAD_VNNI, HEAD_ONEDNN),
    "layers": (LAYERS_VNNI, LAYERS_TORCH),
    "attention": (ATTENTION_LLVM, ATTENTION_SDPA),
}
"""Each role's candidates, in the order they are timed (the ones that can be very
slow last). ``engine_worker.settings.CPU_KERNELS`` names the same ones."""


class KernelUnavailable(ValueError):
    """A candidate that cannot run on this machine or install (or not for these shapes)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One way to run a product: ``call(rows)`` gives a call of it over that many
    rows (built on first use), ``exact()`` checks it on a probe. Both may raise
    ``KernelUnavailable``."""

    name: str
    call: Callable[[int], Callable[[], object]]
    exact: Callable[[], bool]


@dataclass(frozen=True, slots=True)
class Choice:
    """The kernels chosen, each role's candidates' times (µs per call at ``ROWS``
    rows; ``None`` for a row count not timed) and where each role's choice came
    from: ``measured``, ``cached``, ``forced``, or ``only`` (one candidate here)."""

    kernels: Kernels
    times_us: dict[str, dict[str, tuple[float | None, ...]]] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def line(self) -> str:
        """One log line: each role's kernel, how it was chosen, the times."""
        parts = []
        for role, name in self.kernels.names().items():
            times = self.times_us.get(role, {})
            timed = ", ".join(
                f"{candidate} {'/'.join('-' if t is None else f'{t:,.0f}' for t in ts)} µs"
                for candidate, ts in times.items()
            )
            how = self.source.get(role, "only")
            parts.append(f"{role}={name} ({how}{'; ' + timed if timed else ''})")
        rows = "/".join(str(r) for r in ROWS)
        return f"CPU kernels: {', '.join(parts)} [times at {rows} rows; chosen in {self.seconds:.2f} s]"


def time_call(
    call: Callable[[], object],
    budget_s: float,
    clock: Callable[[], float],
    give_up_s: float = float("inf"),
) -> float:
    """Seconds one ``call()`` takes: one warm-up call (first calls allocate and
    fault pages in), then the least of the calls made in ``budget_s`` (at least
    one, at most 100): the least, not the median, since other processes on the
    machine only ever add time to a call, and a choice measured under their load
    is kept. A warm-up that took over ``give_up_s``, or a call that alone used the
    budget, is its own answer."""
    t0 = clock()
    call()
    warm = clock() - t0
    if warm > give_up_s:
        return warm
    times: list[float] = []
    spent = 0.0
    while (spent < budget_s or not times) and len(times) < 100:
        t0 = clock()
        call()
        times.append(clock() - t0)
        spent += times[-1]
    return min(times)


def pick(
    candidates: Sequence[Candidate],
    clock: Callable[[], float] = time.perf_counter,
    budget_s: float = BUDGET_S,
) -> tuple[str | None, dict[str, tuple[float | None, ...]]]:
    """The fastest exact candidate (least total time over ``ROWS``) and every
    candidate's times in µs (``None``: not timed, as ``SLOW``); ``None`` when no
    candidate runs and is exact. Candidates that are unavailable are left out."""
    times: dict[str, tuple[float | None, ...]] = {}
    best = float("inf")
    for candidate in candidates:
        try:
            row_times: list[float | None] = []
            for rows in ROWS:
                if row_times and row_times[0] is not None and row_times[0] > SLOW * best:
                    row_times.append(None)
                    continue
                give_up = max(SLOW * best / 1e6, GIVE_UP_FLOOR_S)  # first calls initialize
                seconds = time_call(candidate.call(rows), budget_s, clock, give_up)
                row_times.append(seconds * 1e6)
        except KernelUnavailable as e:
            log.debug("kernel %s unavailable: %s", candidate.name, e)
            continue
        times[candidate.name] = tuple(row_times)
        if row_times[0] is not None:
            best = min(best, row_times[0])

    def total(name: str) -> float:
        return sum(float("inf") if t is None else t for t in times[name])

    by_name = {c.name: c for c in candidates}
    for name in sorted(times, key=total):
        try:
            if by_name[name].exact():
                return name, times
        except KernelUnavailable:
            pass
        log.warning("kernel %s is not exact on this machine; not used", name)
    return None, times


# ------------------------------------------------------------------ candidates


def _inputs(hidden: int, dtype: torch.dtype = torch.float32) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {rows: torch.randn(rows, hidden, generator=g).to(dtype) for rows in ROWS}


def head_candidates(weight: torch.Tensor) -> list[Candidate]:
    """The LM head's candidates over ``weight`` ``[vocab, hidden]`` (``Int8Head``)."""
    codes, scales = int8_rows(weight)
    x = _inputs(codes.shape[1])
    heads: dict[str, Int8Head] = {}

    def head(kernel: str) -> Int8Head:
        if kernel not in heads:
            try:
                heads[kernel] = Int8Head.of_codes(codes, scales, kernel)
            except ValueError as e:
                raise KernelUnavailable(str(e)) from e
        return heads[kernel]

    def call(kernel: str, rows: int) -> Callable[[], object]:
        built, inputs = head(kernel), x[rows]  # packing and compiling are not timed
        return lambda: built(inputs)

    def candidate(kernel: str) -> Candidate:
        return Candidate(
            kernel,
            lambda rows: call(kernel, rows),
            lambda: head(kernel).exact_on_probe(codes),
        )

    return [candidate(k) for k in CANDIDATES["head"]]


def layer_candidates(weights: Sequence[torch.Tensor]) -> list[Candidate]:
    """The int4 layers' candidates over ``weights`` (``[out, in]`` float32 each: one
    decoder layer's qkv, o, gate/up and down)."""
    built: dict[str, list[QuantizedLinear]] = {}

    def linears(kernel: str) -> list[QuantizedLinear]:
        if kernel not in built:
            made = [QuantizedLinear(w, None, Quantization.INT4, int4_kernel=kernel) for w in weights]
            if any(linear.kernel != kernel for linear in made):
                raise KernelUnavailable(f"the {kernel} int4 kernel does not run here")
            built[kernel] = made
        return built[kernel]

    def call(kernel: str, rows: int) -> Callable[[], object]:
        layers = linears(kernel)
        inputs = [_inputs(w.shape[1], layers[0].input_dtype)[rows] for w in weights]

        def run() -> None:
            for linear, x in zip(layers, inputs, strict=True):
                linear.raw(x)

        return run

    def exact(kernel: str) -> bool:
        linear, weight = linears(kernel)[0], weights[0]
        x = torch.randn(8, weight.shape[1], generator=torch.Generator().manual_seed(1))
        alone = torch.cat([linear(x[i : i + 1]) for i in range(8)])
        if not torch.equal(linear(x), alone):
            return False
        reference = x @ weight.float().T
        return bool((alone - reference).abs().max() <= 0.1 * reference.abs().max())

    return [
        Candidate(k, lambda rows, k=k: call(k, rows), lambda k=k: exact(k))  # type: ignore[misc]
        for k in CANDIDATES["layers"]
    ]


def attention_candidates(head_dim: int, heads: int, kv_heads: int) -> list[Candidate]:
    """Decode attention's candidates: ``ROWS`` queries, each over its own sequence's
    ``CONTEXT`` positions (float32 KV in ``SequenceKV``'s layout, one layer)."""
    g = torch.Generator().manual_seed(2)
    scale = head_dim**-0.5
    most = max(ROWS)
    kv = [torch.randn(1, 2, kv_heads, CONTEXT, head_dim, generator=g) for _ in range(most)]
    queries = torch.randn(most, heads, head_dim, generator=g)
    out = torch.empty(most, heads, head_dim)

    def llvm(rows: int) -> Callable[[], object]:
        if not attention_available(head_dim, heads, kv_heads):
            raise KernelUnavailable("the LLVM decode attention does not run here")
        items = [(queries[i], kv[i], out[i], CONTEXT) for i in range(rows)]
        attend = DecodeAttention(head_dim, heads, kv_heads, scale, items)
        return lambda: attend(0)

    def sdpa(rows: int) -> Callable[[], object]:
        q = [queries[i].view(1, heads, 1, head_dim) for i in range(rows)]
        keys = [kv[i][:, 0] for i in range(rows)]
        values = [kv[i][:, 1] for i in range(rows)]

        def run() -> None:
            for i in range(rows):
                a = F.scaled_dot_product_attention(q[i], keys[i], values[i], scale=scale, enable_gqa=True)
                out[i].copy_(a[0, :, 0])

        return run

    def reference() -> torch.Tensor:
        group = heads // kv_heads
        k = torch.stack([t[0, 0] for t in kv]).double().repeat_interleave(group, 1)  # [most, heads, L, d]
        v = torch.stack([t[0, 1] for t in kv]).double().repeat_interleave(group, 1)
        s = torch.einsum("nhd,nhld->nhl", queries.double(), k) * scale
        return torch.einsum("nhl,nhld->nhd", s.softmax(-1), v).float()

    def exact(make: Callable[[int], Callable[[], object]]) -> bool:
        make(1)()
        alone = out[0].clone()
        make(most)()
        if make is llvm and not torch.equal(out[0], alone):
            return False
        return torch.allclose(out, reference(), rtol=1e-4, atol=1e-4)

    return [
        Candidate(ATTENTION_LLVM, llvm, lambda: exact(llvm)),
        Candidate(ATTENTION_SDPA, sdpa, lambda: exact(sdpa)),
    ]


# ------------------------------------------------------------------ resolving


def _cpu_identity() -> dict[str, str]:
    """The CPU's model name and flags (``/proc/cpuinfo``'s first processor), or what
    ``os.uname`` says where there is none."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
    except OSError:
        pass
    return {
        "model": info.get("model name", os.uname().machine),
        "flags": " ".join(sorted(info.get("flags", info.get("Features", "")).split())),
    }


def fingerprint(shapes: Mapping[str, int], quantization: Quantization, dtype: torch.dtype) -> str:
    """The cache key of a choice: a digest of everything it depends on (module docstring)."""
    cpu = _cpu_identity()
    parts = {
        "format": FORMAT,
        "cpu": cpu["model"],
        "flags": cpu["flags"],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "isa": [
            os.environ.get(v, "") for v in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
        ],
        "llvm": int4.available(),
        "shapes": dict(sorted(shapes.items())),
        "quantization": quantization.value,
        "dtype": str(dtype),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _cached_times(cached: Mapping[str, Any], role: str) -> dict[str, tuple[float | None, ...]]:
    """A cached file's times for ``role`` (µs per row count), what of them is well
    formed: a hand-edited or foreign file must not stop a start."""
    by_role = cached.get("times_us")
    entries = by_role.get(role) if isinstance(by_role, dict) else None
    if not isinstance(entries, dict):
        return {}
    times: dict[str, tuple[float | None, ...]] = {}
    for name, values in entries.items():
        if isinstance(values, list) and all(
            v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in values
        ):
            times[str(name)] = tuple(None if v is None else float(v) for v in values)
    return times


def _write(path: Path, choice: Choice) -> None:
    """Keep a measured choice; an error is one WARNING (the next start measures again)."""
    body = {
        "kernels": choice.kernels.names(),
        "times_us": choice.times_us,
        "cpu": _cpu_identity()["model"],
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(body, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not keep the kernel choice in %s (%s)", path, e)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


@dataclass(frozen=True, slots=True)
class Shapes:
    """What the candidates are built on: the LM head's weight, the first decoder
    layer's four products' weights, and the attention shape."""

    head: torch.Tensor
    layer: Sequence[torch.Tensor]
    head_dim: int
    heads: int
    kv_heads: int

    @classmethod
    def of(cls, model: Any) -> Shapes:
        config = model.config.get_text_config(decoder=True)
        layer = model.get_decoder().layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        heads = int(config.num_attention_heads)
        return cls(
            head=model.get_output_embeddings().weight.detach(),
            layer=[
                torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach().float(),
                attn.o_proj.weight.detach().float(),
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().float(),
                mlp.down_proj.weight.detach().float(),
            ],
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        )

    def key(self) -> dict[str, int]:
        return {
            "vocab": int(self.head.shape[0]),
            "hidden": int(self.head.shape[1]),
            "qkv": int(self.layer[0].shape[0]),
            "intermediate": int(self.layer[3].shape[1]),
            "head_dim": self.head_dim,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
        }


def roles_for(quantization: Quantization, dtype: torch.dtype, layers: str) -> dict[str, tuple[str, ...]]:
    """Each role's candidates under this quantization, the layers' kernel given
    (attention's candidates depend on it: the LLVM attention needs float32
    activations)."""
    float_activations = layers == LAYERS_VNNI or (
        quantization is Quantization.NONE and dtype == torch.float32
    )
    return {
        "head": (HEAD_FLOAT,) if quantization is Quantization.NONE else CANDIDATES["head"],
        "layers": CANDIDATES["layers"] if quantization is Quantization.INT4 else (LAYERS_TORCH,),
        "attention": CANDIDATES["attention"] if float_activations else (ATTENTION_SDPA,),
    }


def resolve(
    model: Any,
    quantization: Quantization,
    *,
    forced: str | None = None,
    cache_dir: Path | None = None,
    make_candidates: Mapping[str, Callable[[Shapes], list[Candidate]]] | None = None,
) -> Choice:
    """The kernels for ``model`` under ``quantization`` on this machine: forced
    (``--cpu-kernels``), else read back from ``cache_dir``, else measured (and
    kept there). Where no candidate of a role is exact on the probe (degenerate
    weights), ``Kernels.default``'s, with a WARNING. Raises ``ValueError`` for a
    forced kernel that is unknown, cannot run here or is not exact."""
    t0 = time.perf_counter()
    wanted = parse_cpu_kernels(forced) if forced else {}
    dtype = next(model.parameters()).dtype
    shapes = Shapes.of(model)
    key = fingerprint(shapes.key(), quantization, dtype)
    path = None if cache_dir is None else cache_dir / "kernels" / f"{key}.json"
    cached = _read(path) if path is not None else {}
    if not cached and key in _MEASURED:  # this process measured these shapes already
        earlier = _MEASURED[key]
        cached = {"kernels": earlier.kernels.names(), "times_us": earlier.times_us}
    cached_kernels: dict[str, str] = (
        cached.get("kernels", {}) if isinstance(cached.get("kernels"), dict) else {}
    )
    builders = make_candidates or {
        "head": lambda s: head_candidates(s.head),
        "layers": lambda s: layer_candidates(s.layer),
        "attention": lambda s: attention_candidates(s.head_dim, s.heads, s.kv_heads),
    }
    chosen: dict[str, str] = {}
    times: dict[str, dict[str, tuple[float | None, ...]]] = {}
    source: dict[str, str] = {}
    for role in ROLES:
        options = roles_for(quantization, dtype, chosen.get("layers", LAYERS_TORCH))[role]
        if role in wanted:
            name = wanted[role]
            if name not in options:
                raise ValueError(
                    f"--cpu-kernels {role}={name}: not a candidate with --quantization {quantization.value}"
                    f"{' and these layers' if role == 'attention' else ''} (candidates: {', '.join(options)})"
                )
            if len(options) > 1:
                _check_forced(role, name, builders[role](shapes))
            chosen[role], source[role] = name, "forced"
        elif len(options) == 1:
            chosen[role], source[role] = options[0], "only"
        elif cached_kernels.get(role) in options:
            chosen[role], source[role] = cached_kernels[role], "cached"
            times[role] = _cached_times(cached, role)
        else:
            candidates = [c for c in builders[role](shapes) if c.name in options]
            fastest, times[role] = pick(candidates)
            if fastest is None:  # degenerate weights (a test's scripted model), or a broken kernel
                fallback = Kernels.default(quantization, dtype).names()[role]
                fastest = fallback if fallback in options else options[-1]
                log.warning("no %s kernel was exact on a probe of this model; using %s", role, fastest)
            chosen[role], source[role] = fastest, "measured"
    choice = Choice(
        Kernels(chosen["head"], chosen["layers"], chosen["attention"]),
        times,
        source,
        time.perf_counter() - t0,
    )
    if "measured" in source.values() and "forced" not in source.values():
        _MEASURED[key] = choice
        if path is not None:
            _write(path, choice)
    return choice


_MEASURED: dict[str, Choice] = {}
"""Choices measured by this process, by ``fingerprint``: a model built again in
memory (tests, benchmarks: no ``cache_dir``) is not measured twice."""


def _check_forced(role: str, name: str, candidates: Iterable[Candidate]) -> None:
    candidate = next(c for c in candidates if c.name == name)
    try:
        candidate.call(ROWS[0])()
        exact = candidate.exact()
    except KernelUnavailable as e:
        raise ValueError(f"--cpu-kernels {role}={name}: {e}") from e
    if not exact:
        raise ValueError(f"--cpu-kernels {role}={name}: not exact on this machine")
