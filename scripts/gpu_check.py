#!/usr/bin/env python3
"""The ExLlamaV3 backend's check on one GPU machine, in one command that fits a 10-minute lease.

Run as ``bash scripts/gpu_check.sh all`` (docs/exllamav3.md, "Checking on a GPU"): the shell
entry installs the wheels carried in ``.whl/`` (``scripts/gpu_check_assets.py`` prepares
them), sets ``MAX_JOBS`` to the cores, ``TORCH_CUDA_ARCH_LIST``, ``TORCH_EXTENSIONS_DIR`` and
``TRITON_CACHE_DIR``, and runs the phases of ``COMMANDS["all"]`` within ``--budget`` (570 s):

- ``env``: versions of torch, CUDA, nvcc and ninja; the environment the build needs.
- ``restore_ext``: a library an earlier run left in pieces, carried in ``.whl/gpu-check-ext/``
  (``CARRIED_EXT``): checked piece by piece, reassembled and installed as the module
  ``exllamav3_ext``, when it was built for this torch, CUDA, Python, architecture list and
  exllamav3. Nothing carried: nothing to do.
- ``build_ext``: unless restored, the extension compiled by exllamav3's own first import
  (``exllamav3/ext.py``: ``torch.utils.cpp_extension.load`` over the package's .cu files) into
  ``TORCH_EXTENSIONS_DIR``, and installed as the module ``exllamav3_ext``, which exllamav3
  imports instead of compiling (``ext.py:21-31``), as in the worker image. A build stopped at
  its timeout leaves its objects (ninja's): the same command on the same machine goes on.
- ``reimport``: a fresh import must load that module, compiling nothing.
- ``pack_ext``: the built library gzip-compressed into at most ``MAX_PIECES`` pieces of under
  16 MiB in the output folder, with a manifest, for ``restore_ext`` on a fresh machine.
- ``model``: a random-weight Llama in Hugging Face format (fp16 safetensors, which ExLlamaV3
  loads without conversion) over the SmolLM2 tokenizer and chat template, and a Qwen2.5-VL
  over the same text weights with a small random vision tower (``write_vision_model``).
- ``warm``: the worker's load (model, cache, ``Model.warmup``, one job through the
  generator): load time, and Triton's kernels compiled into ``TRITON_CACHE_DIR``, so that no
  later step compiles one.
- ``backend``: the backend driven in-process (progress, prefix reuse, stops, aborts,
  re-queues, drafts, the context limit, a Harmony call's frame written by a grammar and read
  by the proxy's ``harmony`` format, a grammar after a reasoning parser's thinking with
  logprobs for the answer only and a stop string the thinking contains, a fault and its
  recovery, the longest ``iterate()`` and whether a heartbeat-like thread kept its pace
  during it).
- ``proxy``: worker and proxy as processes, through HTTP (progress, reuse, the context 400,
  TTFT and the gap between tokens beside the in-process numbers).
- ``images``: the Qwen2.5-VL served the same way: vision announced, a picture's prompt
  tokens in chat, Responses and Messages, the same picture again read from the prefix cache
  past its end, another picture at the same place only up to its first row.

Each phase is a child process with its own timeout inside the budget (and started only with
its minimum left after reserving the later phases' minimums), so one hang cannot eat the
lease; the parent imports nothing heavy. Under ``--out`` (``$OUT`` on the device machine)
the command keeps, as it goes: ``gpu_check_all.json`` (``SUMMARY_KEYS``; rewritten before
and after every phase, a phase in progress marked ``running``), ``gpu_check.log`` (every
phase's output, appended while it runs) and, after a build, the library's pieces and
manifest: at most 7 files, as the device tool brings back 8. Exit status: 0 when every phase
and check passed, 1 otherwise, 2 for bad arguments.

``bash scripts/gpu_check.sh all --dry-run`` runs the same phases on a machine without CUDA,
over the stand-ins in ``tests/fakes/gpu_standin/`` (an ``nvcc``, CUDA in torch, an
``exllamav3`` over the fake engine); CI does (``tests/unit/scripts/test_gpu_check_dry_run.py``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import gzip
import hashlib
import itertools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("GPU_CHECK_WORK") or REPO / "build" / "gpu-check")
TOKENIZER = Path(os.environ.get("GPU_CHECK_TOKENIZER") or REPO / ".whl" / "smollm2-tokenizer")
CARRIED_EXT = Path(os.environ.get("GPU_CHECK_CARRIED_EXT") or REPO / ".whl" / "gpu-check-ext")
"""Where a later run finds the pieces an earlier one left in its output folder."""
EXT_NAME = "exllamav3_ext"
MANIFEST = f"{EXT_NAME}.manifest.json"
PIECE_BYTES = int(os.environ.get("GPU_CHECK_PIECE_BYTES") or 15 * 2**20)
"""Each piece stays under the device tool's 16 MiB per file."""
MAX_PIECES = 4
"""The device tool brings back 8 files, 64 MiB together: summary, log, manifest and 4 pieces."""
LOG_NAME = "gpu_check.log"
LOG_LIMIT_BYTES = 2 * 2**20
SUMMARY_KEYS = ("command", "ok", "budget_s", "total_s", "started_at", "phases", "checks", "metrics")
PHASE_KEYS = ("name", "status", "seconds", "timeout_s", "checks", "metrics", "error", "log")
STATUSES = ("ok", "failed", "timeout", "skipped", "running")


@dataclass(frozen=True)
class Phase:
    """One step of a command: a child process given at most ``timeout_s`` (less when the
    budget runs short), started only with ``min_s`` left after reserving the later
    phases' ``min_s``, and only when the phases in ``needs`` passed. ``argv`` replaces
    the default child (this script's ``phase NAME``)."""

    name: str
    timeout_s: float
    min_s: float = 10.0
    needs: tuple[str, ...] = ()
    argv: tuple[str, ...] | None = None


COMMANDS: dict[str, tuple[Phase, ...]] = {
    "all": (
        Phase("env", 45, min_s=5),
        Phase("restore_ext", 45, min_s=5, needs=("env",)),
        # 194 translation units; not yet timed on the H200 (an estimate from single-file compiles: 180-220 s)
        Phase("build_ext", 390, min_s=60, needs=("env",)),
        Phase("reimport", 60, min_s=10, needs=("build_ext",)),
        Phase("pack_ext", 45, min_s=5, needs=("reimport",)),
        Phase("model", 45, min_s=10),
        Phase("warm", 90, min_s=20, needs=("reimport", "model")),
        Phase("backend", 120, min_s=30, needs=("warm",)),
        Phase("proxy", 100, min_s=30, needs=("warm",)),
        Phase("images", 100, min_s=30, needs=("warm",)),
    ),
}
DEFAULT_BUDGET = {"all": 570.0}
"""Inside the device tool's 600 s per command, with time for the wheels' install."""


# ---------------------------------------------------------------- the parent: phases under a budget


def extension_dir() -> Path:
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or REPO / "build" / "torch_extensions") / EXT_NAME


def installed_module() -> Path:
    """Where the built library goes as the module ``exllamav3_ext``, which exllamav3
    imports instead of compiling (``ext.py:21-31``), as in the worker image: the carried
    wheels' folder, first on ``PYTHONPATH``."""
    return Path(os.environ.get("GPU_CHECK_SITE") or WORK / "site") / f"{EXT_NAME}.so"


def _exllamav3_root() -> Path | None:
    """The exllamav3 package's folder, found without importing it (its import is the build)."""
    import importlib.util

    spec = importlib.util.find_spec("exllamav3")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def count_sources() -> int | None:
    """Translation units the extension build compiles (``.c``/``.cpp``/``.cu`` under
    ``exllamav3_ext``, ROCm ones left out: ``util/cuda_flags.py:extension_sources``)."""
    pkg = _exllamav3_root()
    if pkg is None:
        return None
    root = pkg / EXT_NAME
    return sum(
        1
        for p in root.rglob("*")
        if p.suffix in (".c", ".cpp", ".cu")
        and "rocm" not in p.relative_to(root).parts[:1]
        and "_hip." not in p.name
        and not p.name.startswith("hip_")
    )


def build_progress() -> dict[str, Any]:
    d = extension_dir()
    objects = len(list(d.glob("*.o"))) if d.is_dir() else 0
    return {
        "objects_built": objects,
        "sources": count_sources(),
        "extension_built": any(d.glob(f"{EXT_NAME}*.so")) if d.is_dir() else False,
    }


def clear_stale_lock() -> bool:
    """torch serializes builds with a ``lock`` file in the build folder; a build killed at
    its timeout leaves it behind, and the next import would wait on it forever."""
    lock = extension_dir() / "lock"
    if lock.exists():
        lock.unlink()
        return True
    return False


PRE_HOOKS: dict[str, Callable[[], dict[str, Any]]] = {
    "build_ext": lambda: {"stale_lock_removed": clear_stale_lock(), **build_progress()},
    "reimport": lambda: {"stale_lock_removed": clear_stale_lock()},
}
"""Run by the parent before a phase starts; what they return joins the phase's metrics."""
TIMEOUT_HOOKS: dict[str, Callable[[], dict[str, Any]]] = {
    "build_ext": lambda: {
        **build_progress(),
        "note": "stopped at its timeout; ninja keeps the objects built: "
        "the same command on this machine goes on",
    },
}
"""Run by the parent after a phase timed out."""


# ---------------------------------------------------------------- the built library in pieces


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_env() -> dict[str, str]:
    """What the library is tied to: a module built for another torch, CUDA, Python,
    architecture list or exllamav3 fails to load or misbehaves. Read from the packages'
    ``version.py`` files: importing torch takes seconds, importing exllamav3 builds it."""
    import importlib.util

    def version_file(package: str) -> dict[str, Any]:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            return {}
        path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
        found: dict[str, Any] = {}
        if path.exists():
            exec(compile(path.read_text(), str(path), "exec"), found)  # assignments of literals
        return found

    torch_version = version_file("torch")
    return {
        "torch": str(torch_version.get("__version__")),
        "torch_cuda": str(torch_version.get("cuda")),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "machine": platform.machine(),
        "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST", ""),
        "exllamav3": str(version_file("exllamav3").get("__version__")),
    }


def pack_library(so: Path, out: Path, env: dict[str, str], piece_bytes: int = PIECE_BYTES) -> dict[str, Any]:
    """Write ``so`` gzip-compressed into ``out`` as ``exllamav3_ext.so.gz.NN`` pieces of at
    most ``piece_bytes``, then ``MANIFEST`` (sizes and SHA-256 of the library and of each
    piece, ``env``). Returns the manifest. Raises ``ValueError``, writing nothing, when it
    takes more than ``MAX_PIECES`` pieces."""
    data = so.read_bytes()
    packed = gzip.compress(data, compresslevel=6, mtime=0)
    chunks = [packed[i : i + piece_bytes] for i in range(0, len(packed), piece_bytes)]
    if len(chunks) > MAX_PIECES:
        raise ValueError(
            f"{so.name}: {len(data) / 2**20:.1f} MiB, {len(packed) / 2**20:.1f} MiB compressed, "
            f"needs {len(chunks)} pieces of {piece_bytes / 2**20:.0f} MiB; "
            f"the output folder holds {MAX_PIECES}"
        )
    out.mkdir(parents=True, exist_ok=True)
    pieces = []
    for i, chunk in enumerate(chunks):
        name = f"{EXT_NAME}.so.gz.{i:02d}"
        (out / name).write_bytes(chunk)
        pieces.append({"name": name, "bytes": len(chunk), "sha256": _sha256(chunk)})
    manifest = {
        "format": 1,
        "library": so.name,
        "bytes": len(data),
        "sha256": _sha256(data),
        "compression": "gzip",
        "pieces": pieces,
        "built_for": env,
    }
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(out / MANIFEST)  # last: a manifest names only pieces already written
    return manifest


def unpack_library(folder: Path, env: dict[str, str]) -> bytes:
    """The library from the pieces and ``MANIFEST`` in ``folder``. Raises ``ValueError``
    naming what does not match: a missing or altered piece, the library's checksum, or a
    library built for another ``env`` (the keys of ``build_env``)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    built_for = manifest.get("built_for", {})
    differ = {k: (built_for.get(k), v) for k, v in env.items() if built_for.get(k) != v}
    if differ:
        raise ValueError(f"built for another setup (carried, here): {differ}")
    packed = bytearray()
    for piece in manifest["pieces"]:
        path = folder / piece["name"]
        if not path.exists():
            raise ValueError(f"piece {piece['name']} is missing")
        chunk = path.read_bytes()
        if len(chunk) != piece["bytes"] or _sha256(chunk) != piece["sha256"]:
            raise ValueError(f"piece {piece['name']} differs from the manifest")
        packed += chunk
    data = gzip.decompress(bytes(packed))
    if len(data) != manifest["bytes"] or _sha256(data) != manifest["sha256"]:
        raise ValueError("the reassembled library differs from the manifest")
    return data


def _restored_marker() -> Path:
    return installed_module().with_suffix(".restored")


def restored_module() -> bool:
    """Whether the installed module is the one ``restore_ext`` installed (its checksum)."""
    target, marker = installed_module(), _restored_marker()
    return target.exists() and marker.exists() and marker.read_text().strip() == _sha256(target.read_bytes())


# ---------------------------------------------------------------- running the phases


def _now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def _tail(path: Path, limit: int = 4000, start: int = 0) -> str:
    if not path.exists():
        return ""
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(start, size - limit))
        return f.read().decode("utf-8", errors="replace")


def run_child(argv: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> int | None:
    """Run ``argv`` in its own process group with stdout and stderr appended to ``log``;
    the exit status, or ``None`` when it was killed (with its group) at ``timeout_s``. The
    group stays in the command's session, which the device tool ends with the command."""
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, process_group=0)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


@dataclass
class Runner:
    """Runs the phases of one command within ``budget_s`` seconds."""

    command: str
    phases: tuple[Phase, ...]
    budget_s: float
    work: Path
    out: Path
    options: list[str] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic

    def summary_path(self) -> Path:
        return self.out / f"gpu_check_{self.command}.json"

    def log_path(self) -> Path:
        return self.out / LOG_NAME

    def child_argv(self, phase: Phase, result: Path) -> list[str]:
        if phase.argv is not None:
            return [*phase.argv, str(result)]
        script = str(Path(__file__).resolve())
        return [
            sys.executable,
            script,
            "phase",
            phase.name,
            "--work",
            str(self.work),
            "--result",
            str(result),
        ]

    def _log(self, line: str) -> None:
        with self.log_path().open("a") as f:
            f.write(line + "\n")

    def run(self) -> dict[str, Any]:
        start = self.clock()
        self.work.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path().unlink(missing_ok=True)
        summary: dict[str, Any] = {
            "command": self.command,
            "ok": False,
            "budget_s": self.budget_s,
            "total_s": 0.0,
            "started_at": _now_iso(),
            "phases": [],
            "checks": {},
            "metrics": {},
        }
        passed: set[str] = set()
        for i, phase in enumerate(self.phases):
            elapsed = self.clock() - start
            reserve = sum(p.min_s for p in self.phases[i + 1 :])
            timeout = min(phase.timeout_s, self.budget_s - elapsed - reserve)
            rec: dict[str, Any] = {
                "name": phase.name,
                "status": "skipped",
                "seconds": 0.0,
                "timeout_s": round(max(timeout, 0.0), 1),
                "checks": {},
                "metrics": {},
                "error": None,
                "log": LOG_NAME,
            }
            summary["phases"].append(rec)
            missing = [n for n in phase.needs if n not in passed]
            if missing:
                rec["error"] = f"needs {', '.join(missing)}, which did not pass"
            elif timeout < phase.min_s:
                rec["error"] = f"{timeout:.0f} s of the budget left for it, it needs {phase.min_s:.0f} s"
            else:
                rec["status"] = "running"
                self._finish(summary, start)  # what a kill in this phase leaves behind
                self._log(f"==== [gpu_check] {phase.name} (timeout {timeout:.0f} s) at {_now_iso()}")
                self._run_phase(phase, timeout, rec)
                if rec["status"] == "ok":
                    passed.add(phase.name)
            line = f"[gpu_check] {phase.name}: {rec['status']} in {rec['seconds']} s {rec['error'] or ''}"
            print(line, flush=True)
            self._log(line)
            self._finish(summary, start)
        self._trim_log()
        return summary

    def _run_phase(self, phase: Phase, timeout: float, rec: dict[str, Any]) -> None:
        pre = PRE_HOOKS.get(phase.name)
        if pre is not None:
            rec["metrics"].update(pre())
        result = self.work / f"{self.command}-{phase.name}.result.json"
        result.unlink(missing_ok=True)
        log = self.log_path()
        offset = log.stat().st_size if log.exists() else 0
        env = {**os.environ, "GPU_CHECK_OUT": str(self.out), "PYTHONUNBUFFERED": "1"}
        t0 = self.clock()
        rc = run_child(self.child_argv(phase, result), log, timeout, env)
        rec["seconds"] = round(self.clock() - t0, 1)
        data: dict[str, Any] = {}
        if result.exists():
            try:
                data = json.loads(result.read_text())
            except ValueError as e:
                data = {"error": f"unreadable result: {e}"}
        elif rc == 0:
            data = {"error": "the phase wrote no result"}
        rec["checks"].update(data.get("checks", {}))
        rec["metrics"].update(data.get("metrics", {}))
        if rc is None:
            rec["status"] = "timeout"
            rec["error"] = f"killed after {timeout:.0f} s"
            post = TIMEOUT_HOOKS.get(phase.name)
            if post is not None:
                rec["metrics"].update(post())
        elif rc != 0 or data.get("error"):
            rec["status"] = "failed"
            rec["error"] = data.get("error") or f"exit status {rc}: {_tail(log, 1500, offset)}"
        else:
            rec["status"] = "ok" if all(rec["checks"].values()) else "failed"
            if rec["status"] == "failed":
                rec["error"] = "checks failed: " + ", ".join(k for k, v in rec["checks"].items() if not v)

    def _finish(self, summary: dict[str, Any], start: float) -> None:
        summary["total_s"] = round(self.clock() - start, 1)
        checks: dict[str, bool] = {}
        metrics: dict[str, Any] = {}
        for rec in summary["phases"]:
            checks.update({f"{rec['name']}.{k}": bool(v) for k, v in rec["checks"].items()})
            metrics.update({f"{rec['name']}.{k}": v for k, v in rec["metrics"].items()})
        metrics.update(compare_latency(metrics))
        summary["checks"] = checks
        summary["metrics"] = metrics
        summary["ok"] = bool(summary["phases"]) and all(r["status"] == "ok" for r in summary["phases"])
        tmp = self.summary_path().with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n")
        tmp.replace(self.summary_path())

    def _trim_log(self) -> None:
        """The log's last ``LOG_LIMIT_BYTES`` (a file comes back only under 16 MiB)."""
        log = self.log_path()
        if log.exists() and log.stat().st_size > LOG_LIMIT_BYTES:
            log.write_bytes(_tail(log, LOG_LIMIT_BYTES).encode())


def compare_latency(metrics: dict[str, Any]) -> dict[str, Any]:
    """Proxy minus in-process time to first token and mean gap between tokens, seconds."""
    out: dict[str, Any] = {}
    for key in ("ttft_s", "itl_s"):
        direct, proxied = metrics.get(f"backend.{key}"), metrics.get(f"proxy.{key}")
        if isinstance(direct, int | float) and isinstance(proxied, int | float):
            out[f"proxy_minus_backend.{key}"] = round(proxied - direct, 4)
    return out


# ---------------------------------------------------------------- the children: one phase each


class Result:
    """What a phase reports: named checks (bool) and metrics (JSON values)."""

    def __init__(self) -> None:
        self.checks: dict[str, bool] = {}
        self.metrics: dict[str, Any] = {}

    def check(self, name: str, ok: bool, **metrics: Any) -> bool:
        self.checks[name] = bool(ok)
        self.metrics.update(metrics)
        print(f"  {'ok  ' if ok else 'FAIL'} {name} {metrics or ''}", flush=True)
        return bool(ok)

    def attempt(self, name: str, fn: Callable[[], None]) -> None:
        """Run one scenario; an exception fails its check and the phase goes on."""
        try:
            fn()
        except Exception as e:
            import traceback

            traceback.print_exc()
            self.check(name, False, **{f"{name}_error": f"{type(e).__name__}: {e}"[:500]})


def phase_env(work: Path, res: Result) -> None:
    import torch

    res.metrics.update(
        {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST"),
            "MAX_JOBS": os.environ.get("MAX_JOBS"),
            "cores": len(os.sched_getaffinity(0)),
            "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR"),
            "TRITON_CACHE_DIR": os.environ.get("TRITON_CACHE_DIR"),
            "sources": count_sources(),
        }
    )
    # The build runs MAX_JOBS compilers at once; Triton writes its kernels where this says.
    res.check("max_jobs_is_cores", os.environ.get("MAX_JOBS") == str(len(os.sched_getaffinity(0))))
    res.check("arch_list_set", bool(os.environ.get("TORCH_CUDA_ARCH_LIST")))
    res.check("triton_cache_dir_set", bool(os.environ.get("TRITON_CACHE_DIR")))
    cuda = torch.cuda.is_available()
    res.check("cuda_available", cuda)
    if cuda:
        res.metrics["gpu"] = torch.cuda.get_device_name(0)
        res.metrics["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
        release = text.rsplit("release ", 1)[1].split(",")[0] if "release " in text else ""
    except OSError:
        release = ""
    res.metrics["nvcc"] = release or None
    # cpp_extension refuses a toolkit whose major version differs from torch's CUDA
    res.check(
        "nvcc_matches_torch_cuda",
        bool(release) and release.split(".")[0] == str(torch.version.cuda).split(".")[0],
    )
    res.check("ninja_found", shutil.which("ninja") is not None)
    res.check("exllamav3_installed", count_sources() is not None)


def phase_restore_ext(work: Path, res: Result) -> None:
    """A library an earlier run packed (``pack_ext``), carried in ``CARRIED_EXT``: checked,
    reassembled and installed as the module, so that ``build_ext`` has nothing to do."""
    marker = _restored_marker()
    marker.unlink(missing_ok=True)
    if not (CARRIED_EXT / MANIFEST).exists():
        res.metrics.update({"carried": False, "carried_dir": str(CARRIED_EXT)})
        return
    t0 = time.monotonic()
    data = unpack_library(CARRIED_EXT, build_env())  # ValueError: the phase fails, the build runs
    target = installed_module()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(target)
    marker.write_text(_sha256(data))
    res.metrics.update({"carried": True, "restore_s": round(time.monotonic() - t0, 1)})
    res.check("restored", restored_module(), restored_bytes=len(data), module_path=str(target))


def phase_build_ext(work: Path, res: Result) -> None:
    target = installed_module()
    if restored_module():
        res.metrics.update({"build_s": 0.0, "restored": True, **build_progress()})
        res.check("installed_as_module", True, module_path=str(target))
        return
    if target.exists():
        target.unlink()  # else exllamav3 would load it instead of building (ext.py:30-31)
    t0 = time.monotonic()
    error = None
    try:
        import exllamav3.ext  # noqa: F401  (the import is the build)
    except Exception as e:
        # The build can succeed and the import fail later for another reason; the .so says.
        error = f"{type(e).__name__}: {e}"
    took = round(time.monotonic() - t0, 1)
    print(f"extension build (import exllamav3.ext): {took} s", flush=True)
    progress = build_progress()
    res.metrics.update({"build_s": took, "restored": False, **progress})
    res.check("extension_built", progress["extension_built"], import_error=error)
    res.check("import_ok", error is None)
    built = sorted(extension_dir().glob(f"{EXT_NAME}*.so"))
    if built:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built[-1], target)
    res.check("installed_as_module", target.exists(), module_path=str(target))


def phase_reimport(work: Path, res: Result) -> None:
    """What a worker start does: import exllamav3, which must load the installed module
    (no compiler run, nothing written)."""
    if not installed_module().exists():
        # Importing would start a build of several minutes inside a short phase.
        raise RuntimeError(f"no {installed_module()}: the build_ext phase did not install it")
    t0 = time.monotonic()
    import exllamav3
    import exllamav3.ext
    from exllamav3.version import __version__

    took = round(time.monotonic() - t0, 1)
    loaded = Path(getattr(exllamav3.ext.exllamav3_ext, "__file__", "") or "")
    res.metrics.update({"import_s": took, "exllamav3": __version__, "extension": str(loaded)})
    res.check("precompiled_module_loaded", loaded.resolve() == installed_module().resolve())
    res.check("exllamav3_is_1.6.5", __version__ == "1.6.5")


def phase_pack_ext(work: Path, res: Result) -> None:
    """The built library in pieces in the output folder (``pack_library``), for a later
    run on a fresh machine; nothing new when it was restored from pieces."""
    if restored_module():
        res.metrics.update({"packed": False, "note": "restored from carried pieces"})
        return
    out = Path(os.environ.get("GPU_CHECK_OUT") or WORK / "out")
    t0 = time.monotonic()
    manifest = pack_library(installed_module(), out, build_env())
    res.metrics.update(
        {
            "packed": True,
            "pack_s": round(time.monotonic() - t0, 1),
            "library_bytes": manifest["bytes"],
            "pieces": [p["name"] for p in manifest["pieces"]],
            "packed_bytes": sum(p["bytes"] for p in manifest["pieces"]),
        }
    )
    res.check("pieces_under_16_mib", all(p["bytes"] < 16 * 2**20 for p in manifest["pieces"]))


# ---------------------------------------------------------------- the model


CHAT_PROMPT = "Summarise these notes. " + " ".join(
    f"Note {i}: the sidecar streams prefill progress and reports cache reuse."
    for i in range(int(os.environ.get("GPU_CHECK_PROMPT_NOTES") or 110))
)
"""About 1,500 tokens of SmolLM2's tokenizer (the dry run's byte tokenizer asks for fewer notes)."""


def phase_model(work: Path, res: Result, tokenizer_dir: Path = TOKENIZER) -> None:
    """A 2-layer random-weight Llama over the SmolLM2 vocabulary. The output head is the
    embedding table and the embeddings are large, so the model repeats its last token:
    n-gram drafts get accepted and outputs are predictable enough to test stops."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = work / "model"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if not (tokenizer_dir / f).exists():
            raise RuntimeError(f"{tokenizer_dir / f} missing: run scripts/gpu_check_assets.py and carry .whl")
        shutil.copy(tokenizer_dir / f, out / f)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    vocab = json.loads((out / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in vocab.get("added_tokens", [])}
    size = max([*vocab["model"]["vocab"].values(), *ids.values()]) + 1
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=size,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=ids.get(tok_config.get("bos_token")),
        eos_token_id=ids.get(tok_config.get("eos_token")),
        pad_token_id=ids.get(tok_config.get("pad_token")),
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.mul_(50.0)
        model.lm_head.weight.copy_(emb)
    model.half().save_pretrained(str(out))  # safetensors, the only format transformers 5 writes
    res.metrics.update({"vocab_size": size, "model_dir": str(out)})
    res.check("model_written", (out / "config.json").exists() and any(out.glob("*.safetensors")))
    vision = write_vision_model(out, work / "vision-model")
    res.check("vision_model_written", (vision / "visual.safetensors").exists(), vision_model_dir=str(vision))


VISION_TOWER = {
    "depth": 2,
    "fullatt_block_indexes": [1],
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_heads": 4,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "spatial_patch_size": 14,
    "temporal_patch_size": 2,
    "window_size": 112,
}
"""A small Qwen2.5-VL vision tower: every key 1.6.5's ``read_qwen2_5_vl_vision_config``
reads (``architecture/qwen2_5_vl.py:85-114``); ``out_hidden_size`` is the text model's."""
IMAGE_SIDE = 56
"""Pixels a side of the check's pictures: at or above the preprocessor's ``min_pixels`` (56 x 56),
so 1.6.5's ``qwen2_smart_resize`` keeps the size and the grid is (1, 4, 4) patches."""


def image_tokens_expected() -> int:
    """Prompt tokens of one ``IMAGE_SIDE`` square picture on the tower above, computed from
    Qwen2.5-VL's rule, not read off the engine: 14-pixel patches merged 2 x 2 into one
    embedding row each (``architecture/qwen2_5_vl.py:328-347``), between the start and end tokens
    (``architecture/qwen2_5_vl.py:434-436``): 4 rows, 6 tokens."""
    patches = (IMAGE_SIDE // VISION_TOWER["patch_size"]) ** 2
    return patches // VISION_TOWER["spatial_merge_size"] ** 2 + 2


def write_vision_model(llama: Path, out: Path) -> Path:
    """A Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``) over the Llama's weights: the text
    model's keys are the ones 1.6.5 reads for it (``model.layers.*``, ``model.norm``,
    ``lm_head``: ``architecture/llama.py:62-133``; Qwen2's q/k/v biases are optional,
    ``architecture/qwen2.py:8-9``), so its answers repeat as the Llama's do; ``visual.*`` holds a random
    ``VISION_TOWER`` (``architecture/qwen2_5_vl.py:187-266``), and ``preprocessor_config.json`` what
    ``read_qwen2_5_vl_pp_config`` needs (``architecture/qwen2_5_vl.py:117-147``). The start and end tokens
    are the vocabulary's ``[`` and ``]`` (the byte tokenizer of the dry run has no spare
    special tokens). Returns ``out``."""
    import torch
    from safetensors.torch import save_file

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for f in llama.iterdir():
        if f.name != "config.json":
            try:
                os.link(f, out / f.name)
            except OSError:
                shutil.copy(f, out / f.name)
    cfg = json.loads((llama / "config.json").read_text())
    vocab = json.loads((llama / "tokenizer.json").read_text())["model"]["vocab"]
    hidden, v = cfg["hidden_size"], VISION_TOWER
    head_half = cfg["head_dim"] // 2
    cfg.update(
        {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "hidden_act": "silu",
            # contiguous T/H/W sections of the rotary frequencies (Qwen2.5-VL's layout, util/rope.py:493-500)
            "rope_scaling": {
                "type": "mrope",
                "mrope_section": [head_half // 4, 3 * head_half // 8, 3 * head_half // 8],
            },
            "vision_config": {**v, "out_hidden_size": hidden, "model_type": "qwen2_5_vl"},
            "vision_start_token_id": vocab["["],
            "vision_end_token_id": vocab["]"],
        }
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    pp = {
        "image_processor_type": "Qwen2_5_VLImageProcessor",
        "patch_size": v["patch_size"],
        "temporal_patch_size": v["temporal_patch_size"],
        "merge_size": v["spatial_merge_size"],
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": IMAGE_SIDE * IMAGE_SIDE,
        "max_pixels": 1024 * 28 * 28,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(pp, indent=1))
    h, i, p, t = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["temporal_patch_size"]
    merged = h * v["spatial_merge_size"] ** 2
    g = torch.Generator().manual_seed(1)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).half()

    tensors = {"visual.patch_embed.proj.weight": rand(h, 3, t, p, p)}
    for b in range(v["depth"]):
        k = f"visual.blocks.{b}"
        tensors |= {
            f"{k}.norm1.weight": torch.ones(h).half(),
            f"{k}.norm2.weight": torch.ones(h).half(),
            f"{k}.attn.qkv.weight": rand(3 * h, h),
            f"{k}.attn.qkv.bias": rand(3 * h),
            f"{k}.attn.proj.weight": rand(h, h),
            f"{k}.attn.proj.bias": rand(h),
            f"{k}.mlp.gate_proj.weight": rand(i, h),
            f"{k}.mlp.gate_proj.bias": rand(i),
            f"{k}.mlp.up_proj.weight": rand(i, h),
            f"{k}.mlp.up_proj.bias": rand(i),
            f"{k}.mlp.down_proj.weight": rand(h, i),
            f"{k}.mlp.down_proj.bias": rand(h),
        }
    tensors |= {
        "visual.merger.ln_q.weight": torch.ones(h).half(),
        "visual.merger.mlp.0.weight": rand(merged, merged),
        "visual.merger.mlp.0.bias": rand(merged),
        "visual.merger.mlp.2.weight": rand(hidden, merged),
        "visual.merger.mlp.2.bias": rand(hidden),
    }
    save_file(tensors, str(out / "visual.safetensors"), metadata={"format": "pt"})
    return out


# ---------------------------------------------------------------- the backend, in-process


class RecordingGenerator:
    """Passes the backend's calls to the real generator, timing ``iterate()`` and keeping
    its results; ``fail_next`` makes the next ``iterate()`` raise it (a fault)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.results: list[dict[str, Any]] = []
        self.iterate_s: list[float] = []
        self.fail_next: Exception | None = None

    def enqueue(self, job: Any) -> int:
        return int(self.inner.enqueue(job))

    def cancel(self, job: Any) -> None:
        self.inner.cancel(job)

    def num_remaining_jobs(self) -> int:
        return int(self.inner.num_remaining_jobs())

    @property
    def pending_jobs(self) -> list[Any]:
        return list(self.inner.pending_jobs)

    def iterate(self) -> list[dict[str, Any]]:
        if self.fail_next is not None:
            e, self.fail_next = self.fail_next, None
            raise e
        t0 = time.monotonic()
        out: list[dict[str, Any]] = self.inner.iterate()
        self.iterate_s.append(time.monotonic() - t0)
        self.results += out
        return out


class PaceMonitor:
    """A thread that wakes every ``tick`` seconds, as the worker's heartbeat thread does,
    and records the longest gap between its wake-ups: a step that holds the GIL would
    show here as a gap as long as the step."""

    def __init__(self, tick: float = 0.02) -> None:
        import threading

        self.tick = tick
        self.max_gap = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            self.max_gap = max(self.max_gap, now - last)
            last = now

    def __enter__(self) -> PaceMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def lifecycle_problems(events: list[Any], rid: str) -> list[str]:
    """The per-request order of ``protocol.messages`` for a request that finished."""
    from protocol.messages import Finished, PrefillProgress, RequestError, Started, TokenDelta

    evs = [e for e in events if e.request_id == rid]
    problems = []
    if not evs or not isinstance(evs[-1], Finished):
        return [f"does not end with Finished: {evs[-1:]!r}"]
    if not isinstance(evs[0], Started):
        problems.append("does not begin with Started")
    if sum(isinstance(e, Finished | RequestError) for e in evs) != 1:
        problems.append("not exactly one terminal event")
    prog = [e.processed for e in evs if isinstance(e, PrefillProgress)]
    first_delta = next((i for i, e in enumerate(evs) if isinstance(e, TokenDelta)), len(evs))
    last_prog = max((i for i, e in enumerate(evs) if isinstance(e, PrefillProgress)), default=-1)
    if not prog or prog != sorted(set(prog)):
        problems.append(f"progress not strictly rising: {prog}")
    if (
        isinstance(evs[0], Started)
        and prog
        and (prog[0] != evs[0].cached_tokens or prog[-1] != evs[0].prompt_tokens)
    ):
        problems.append(f"progress {prog[0]}..{prog[-1]} is not cached..total")
    if last_prog > first_delta:
        problems.append("progress after the first token")
    return problems


def _settings(work: Path) -> Any:
    """The worker settings of the in-process phases (the proxy phase passes the same as flags)."""
    from engine_worker.settings import WorkerSettings

    return WorkerSettings(
        backend="exllamav3",
        model_dir=work / "model",
        draft_mode="ngram",
        max_seq_len=4096,
        cache_size=16384,
        chunk_size=256,
        max_batch_size=8,
    )


def _files_under(path: str | None) -> int:
    return sum(1 for p in Path(path).rglob("*") if p.is_file()) if path and Path(path).is_dir() else 0


def phase_warm(work: Path, res: Result) -> None:
    """The worker's load with warm-up, timed: Triton compiles its kernels into
    ``TRITON_CACHE_DIR`` here, not inside a later step (whose length the heartbeat check
    watches)."""
    from engine_worker.exllamav3.loader import load_engine

    triton = os.environ.get("TRITON_CACHE_DIR")
    before = _files_under(triton)
    t0 = time.monotonic()
    handle = load_engine(_settings(work))
    res.metrics.update(
        {
            "load_s": round(time.monotonic() - t0, 1),
            "generator_warmup_s": round(handle.warmup_s, 2),
            "triton_cache_files_before": before,
            "triton_cache_files": _files_under(triton),
        }
    )
    handle.close()
    res.check("triton_cache_dir_set", bool(triton))


def phase_backend(work: Path, res: Result) -> None:
    from engine_worker.admission import checked_prepare
    from engine_worker.backend import RequestRejected
    from engine_worker.exllamav3.backend import ExLlamaV3Backend
    from engine_worker.exllamav3.loader import load_engine
    from protocol.messages import (
        Channel,
        ChatMessage,
        ErrorCode,
        Event,
        Finished,
        FinishReason,
        PrefillProgress,
        RequestError,
        SamplingParams,
        Started,
        Submit,
        TokenDelta,
    )

    settings = _settings(work)
    t0 = time.monotonic()
    handle = load_engine(settings)
    res.metrics.update(
        {"load_s": round(time.monotonic() - t0, 1), "generator_warmup_s": round(handle.warmup_s, 2)}
    )
    rec = RecordingGenerator(handle.generator)
    import dataclasses

    handle = dataclasses.replace(handle, generator=rec)
    backend = ExLlamaV3Backend(handle, settings)
    res.metrics["stop_strings"] = list(handle.stop_strings)

    def add(b: ExLlamaV3Backend, s: Submit) -> None:
        # As the worker loop admits a request: validated, prepared, given its budget.
        b.start(s.request_id, checked_prepare(b, s), s.params)

    def chat(rid: str, text: str, **p: Any) -> Submit:
        p.setdefault("max_tokens", 32)
        p.setdefault("temperature", 0.0)
        return Submit(rid, SamplingParams(**p), messages=(ChatMessage("user", text),))

    def raw(rid: str, text: str, **p: Any) -> Submit:
        p.setdefault("max_tokens", 16)
        p.setdefault("temperature", 0.0)
        return Submit(rid, SamplingParams(**p), prompt=text)

    def drive(
        b: ExLlamaV3Backend, *submits: Submit, limit: int = 4000
    ) -> tuple[list[Event], dict[str, list[float]]]:
        """Start ``submits`` and step until none is active. ``times["<id>:<Event>"]``: the
        seconds since the start at which each event of that kind arrived."""
        events: list[Event] = []
        times: dict[str, list[float]] = {}
        start = time.monotonic()
        for s in submits:
            add(b, s)
        for _ in range(limit):
            if not b.active_ids():
                break
            step = b.step()
            now = time.monotonic() - start
            for e in step:
                times.setdefault(f"{e.request_id}:{type(e).__name__}", []).append(now)
            events += step
        else:
            raise RuntimeError(f"still active after {limit} steps")
        return events, times

    def of(events: list[Event], rid: str) -> list[Event]:
        return [e for e in events if e.request_id == rid]

    def text_of(events: list[Event], rid: str) -> str:
        return "".join(e.text for e in of(events, rid) if isinstance(e, TokenDelta))

    def fin(events: list[Event], rid: str) -> Finished:
        (f,) = [e for e in of(events, rid) if isinstance(e, Finished)]
        return f

    with PaceMonitor() as pace:

        def progress() -> None:
            events, times = drive(backend, chat("p1", CHAT_PROMPT, max_tokens=64))
            problems = lifecycle_problems(events, "p1")
            prog = [e for e in of(events, "p1") if isinstance(e, PrefillProgress)]
            f = fin(events, "p1")
            deltas = times.get("p1:TokenDelta", [])
            gaps = [b - a for a, b in itertools.pairwise(deltas)]
            res.check(
                "progress_rises_to_total",
                not problems and len(prog) >= 4,
                problems=problems,
                progress_chunks=len(prog),
            )
            res.metrics.update(
                {
                    "prompt_tokens": f.prompt_tokens,
                    "ttft_s": round(deltas[0], 4) if deltas else None,
                    "itl_s": round(sum(gaps) / len(gaps), 5) if gaps else None,
                    "completion_tokens": f.completion_tokens,
                }
            )
            res.check(
                "ngram_draft_counters",
                f.draft_accepted is not None and f.draft_rejected is not None and f.draft_accepted > 0,
                draft_accepted=f.draft_accepted,
                draft_rejected=f.draft_rejected,
            )
            again, _ = drive(backend, chat("p2", CHAT_PROMPT, max_tokens=8))
            f2 = fin(again, "p2")
            started = of(again, "p2")[0]
            res.check(
                "repeat_reuses_prefix",
                f2.cached_tokens >= f2.prompt_tokens - 256
                and isinstance(started, Started)
                and started.cached_tokens == f2.cached_tokens,
                cached_tokens_repeat=f2.cached_tokens,
                started_cached_repeat=getattr(started, "cached_tokens", None),
            )

        def max_tokens_one() -> None:
            events, _ = drive(backend, raw("m1", "The quick brown fox", max_tokens=1))
            f = fin(events, "m1")
            res.check(
                "max_tokens_1",
                f.completion_tokens == 1
                and f.finish_reason is FinishReason.LENGTH
                and not lifecycle_problems(events, "m1"),
                max_tokens_1_text=text_of(events, "m1"),
            )

        def stop_string() -> None:
            events, _ = drive(backend, raw("s0", "Once upon a time there was", max_tokens=12))
            plain = text_of(events, "s0")
            stop = plain[len(plain) // 2 : len(plain) // 2 + 2]
            if len(plain) < 4 or not stop.strip():
                res.check("stop_string", False, stop_string_plain=plain)
                return
            events, _ = drive(backend, raw("s1", "Once upon a time there was", max_tokens=12, stop=(stop,)))
            f = fin(events, "s1")
            res.check(
                "stop_string",
                f.finish_reason is FinishReason.STOP and text_of(events, "s1") == plain[: plain.find(stop)],
                stop_string_plain=plain,
                stop_string=stop,
                stop_string_text=text_of(events, "s1"),
            )

        def stop_token_with_held_text() -> None:
            # The first two tokens repeat the prompt's last one (T); a stop string that T's
            # text begins holds them back; the stop token, masked for two tokens and then
            # forced by a bias, ends the job with them still held (job.py:978-993).
            prompt = "The quick brown fox"
            plain, _ = drive(backend, raw("h0", prompt, max_tokens=2))
            t_ids = [
                int(t) for r in rec.results if r.get("identifier") == "h0" for t in _ids(r.get("token_ids"))
            ]
            if not t_ids:
                res.check("stop_token_held_text", False, held_error="no token ids seen")
                return
            piece = handle.pieces[t_ids[0]]
            stop_id = handle.encode("Zebra", False).tolist()[0][-1]
            n_before = len(rec.results)
            events, _ = drive(
                backend,
                raw(
                    "h1",
                    prompt,
                    max_tokens=8,
                    min_tokens=2,
                    stop_token_ids=(stop_id,),
                    logit_bias={stop_id: 1e6},
                    stop=(piece + "\u00a7\u00a7",),
                ),
            )
            eos = [r for r in rec.results[n_before:] if r.get("identifier") == "h1" and r.get("eos")]
            held = (eos[-1].get("held") or {}).get("text", "") if eos else ""
            f = fin(events, "h1")
            res.check(
                "stop_token_held_text",
                f.finish_reason is FinishReason.STOP
                and bool(eos)
                and eos[-1].get("eos_reason") == "stop_token"
                and held.startswith(piece)
                and text_of(events, "h1") == text_of(plain, "h0"),
                held_engine=held,
                held_text=text_of(events, "h1"),
                held_piece=piece,
            )

        def aborts() -> None:
            add(backend, chat("a-prefill", "Another long one. " + CHAT_PROMPT))
            add(backend, raw("a-decode", "The quick brown fox", max_tokens=400))
            aborted: set[str] = set()
            after: list[Event] = []
            for _ in range(2000):
                if not backend.active_ids():
                    break
                for e in backend.step():
                    if e.request_id in aborted:
                        after.append(e)
                    elif e.request_id == "a-prefill" and isinstance(e, PrefillProgress):
                        if e.cached < e.processed < e.total:
                            backend.abort("a-prefill")
                            aborted.add("a-prefill")
                    elif e.request_id == "a-decode" and isinstance(e, TokenDelta):
                        backend.abort("a-decode")
                        aborted.add("a-decode")
            res.check(
                "abort_in_prefill_and_decode",
                set(aborted) == {"a-prefill", "a-decode"} and not after and rec.num_remaining_jobs() == 0,
                aborted=sorted(aborted),
                events_after_abort=len(after),
            )

        def requeue() -> None:
            rq = ExLlamaV3Backend(handle, dataclasses.replace(settings, max_rq_tokens=256))
            n_before = len(rec.results)
            # pages of 256 and max_rq_tokens 256: a re-queue about every 256 tokens after the first 512
            events, _ = drive(rq, raw("rq", "The quick brown fox", max_tokens=1000, ignore_eos=True))
            requeues = sum(1 for r in rec.results[n_before:] if r.get("requeue"))
            f = fin(events, "rq")
            tokens = sum(e.num_tokens for e in of(events, "rq") if isinstance(e, TokenDelta))
            problems = lifecycle_problems(events, "rq")
            res.check(
                "requeue_usage_and_progress",
                requeues >= 2
                and not problems
                and f.completion_tokens == 1000
                and tokens == 1000
                and f.prompt_tokens == of(events, "rq")[0].prompt_tokens,  # type: ignore[union-attr]
                requeues=requeues,
                requeue_problems=problems,
                requeue_completion_tokens=f.completion_tokens,
                requeue_delta_tokens=tokens,
            )

        def context() -> None:
            try:
                checked_prepare(backend, raw("ctx", "word " * 6000))
            except RequestRejected as e:
                res.check("context_length_exceeded", e.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED)
            else:
                res.check("context_length_exceeded", False)

        def fault() -> None:
            add(backend, raw("f1", "The quick brown fox", max_tokens=50))
            backend.step()
            rec.fail_next = RuntimeError("injected fault (gpu_check)")
            step = backend.step()
            failed = [e.request_id for e in step if isinstance(e, RequestError)]
            events, _ = drive(backend, raw("f2", "Once upon a time", max_tokens=8))
            res.check(
                "fault_rebuilds_the_generator",
                failed == ["f1"]
                and fin(events, "f2").completion_tokens > 0
                and backend._h.generator is not rec,
                fault_failed=failed,
            )

        def grammar_after_thinking() -> None:
            # deepseek_r1 starts inside the span: what the model writes is thinking until the
            # budget's forced </think> (several tokens here); the grammar then writes the
            # answer through 1.6.5's own Filter API (grammar.answer_filter_factory), only the
            # answer carries logprobs, and a stop string that the thinking contains stops nothing.
            thinker = ExLlamaV3Backend(handle, dataclasses.replace(settings, reasoning_parser="deepseek_r1"))
            n_before = len(rec.results)
            first = chat(
                "g1",
                "Say ok.",
                grammar='start: "ok"',
                grammar_param="response_format",
                reasoning_budget=4,
                logprobs=1,
            )
            events, _ = drive(thinker, first)
            deltas = [e for e in of(events, "g1") if isinstance(e, TokenDelta)]
            thinking = "".join(d.text for d in deltas if d.channel is Channel.REASONING)
            answer = [d for d in deltas if d.channel is Channel.CONTENT]
            mine = [r for r in rec.results[n_before:] if r.get("identifier") == "g1" and r.get("eos")]
            eos = [r.get("eos_reason") for r in mine]
            entries = [e.token for d in answer for e in d.logprobs or ()]
            f = fin(events, "g1")
            ok = (
                bool(thinking)
                and "".join(d.text for d in answer) == "ok"
                and "".join(entries) == "ok"
                and all(d.logprobs is None for d in deltas if d.channel is Channel.REASONING)
                and f.finish_reason is FinishReason.STOP
                and eos == ["end_filter"]
            )
            stop = thinking[:2]
            again = chat("g2", "Say ok.", stop=(stop,), reasoning_budget=4, max_tokens=12) if stop else None
            second = drive(thinker, again)[0] if again is not None else []
            thinking2 = "".join(
                e.text
                for e in of(second, "g2")
                if isinstance(e, TokenDelta) and e.channel is Channel.REASONING
            )
            res.check(
                "grammar_after_thinking",
                ok and thinking2 == thinking,
                thinking=thinking,
                thinking_with_stop=thinking2,
                answer="".join(d.text for d in answer),
                answer_logprob_tokens=entries,
                eos_reasons=eos,
            )

        def harmony_call() -> None:
            # The frame GPT-OSS writes for a call, as the content the worker sends for it
            # (engine_worker.reasoning.gpt_oss): written here by a grammar over this model's
            # ordinary tokens (the SmolLM2 vocabulary has no Harmony tokens), streamed by the
            # real Job and read by the proxy's harmony format into one call.
            from proxy.tools import HARMONY, parse_output
            from proxy.tools.spec import FunctionTool, ToolConfig

            frame = (
                '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
            )
            lark = "start: " + json.dumps(frame)
            request = raw("hc", "Weather?", grammar=lark, grammar_param="tool_choice", max_tokens=256)
            events, _ = drive(backend, request)
            text = text_of(events, "hc")
            config = ToolConfig(tools=(FunctionTool(name="get_weather"),))
            parsed = parse_output(HARMONY, config, text)
            calls = [(c.function.name, c.function.arguments) for c in parsed.tool_calls]
            res.check(
                "harmony_call",
                text == frame and calls == [("get_weather", '{"city":"Paris"}')] and parsed.content is None,
                harmony_text=text,
                harmony_calls=calls,
            )

        for name, fn in (
            ("progress_rises_to_total", progress),
            ("max_tokens_1", max_tokens_one),
            ("stop_string", stop_string),
            ("stop_token_held_text", stop_token_with_held_text),
            ("abort_in_prefill_and_decode", aborts),
            ("requeue_usage_and_progress", requeue),
            ("context_length_exceeded", context),
            ("harmony_call", harmony_call),
            # its own backend over the same generator, as requeue's: after the others
            ("grammar_after_thinking", grammar_after_thinking),
            ("fault_rebuilds_the_generator", fault),
        ):
            res.attempt(name, fn)
    res.metrics.update(
        {
            "iterate_s_max": round(max(rec.iterate_s, default=0.0), 4),
            "iterate_count": len(rec.iterate_s),
            "longest_step_s": round(backend.longest_step_s, 4),
            "pace_gap_max_s": round(pace.max_gap, 4),
        }
    )
    # Heartbeats come from a thread: they keep their pace only if steps let go of the GIL.
    res.check("heartbeat_pace_kept", pace.max_gap < 0.5)
    backend.close()


def _ids(t: Any) -> list[int]:
    if t is None:
        return []
    rows = t.tolist()
    return [int(x) for x in (rows[0] if rows and isinstance(rows[0], list) else rows)]


# ---------------------------------------------------------------- worker and proxy, over HTTP


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(base: str, path: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        base + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def stream_chat(base: str, prompt: str, max_tokens: int, timeout: float = 60) -> dict[str, Any]:
    """One streamed chat request with progress and usage; arrival times per chunk."""
    import urllib.request

    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_progress": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    t0 = time.monotonic()
    progress: list[dict[str, Any]] = []
    content_t: list[float] = []
    usage: dict[str, Any] | None = None
    error = None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            now = time.monotonic() - t0
            if "error" in ev:
                error = ev["error"]
            if ev.get("prompt_progress"):
                progress.append(ev["prompt_progress"])
            if ev.get("usage") and not ev.get("choices"):
                usage = ev["usage"]
            if any(c["delta"].get("content") for c in ev.get("choices", [])):
                content_t.append(now)
    gaps = [b - a for a, b in itertools.pairwise(content_t)]
    return {
        "progress": progress,
        "usage": usage,
        "error": error,
        "ttft_s": content_t[0] if content_t else None,
        "itl_s": sum(gaps) / len(gaps) if gaps else None,
    }


@contextlib.contextmanager
def served(work: Path, res: Result, engine: list[str], name: str, wait_s: float = 75) -> Iterator[str | None]:
    """Worker (``engine``: its engine options) and proxy as processes over IPC: yields the
    proxy's base URL once ``/ready`` answers 200 within ``wait_s``, else ``None`` (the check
    ``ready`` fails and ``ready_s`` says how long it waited). Stops both on the way out, and
    prints the last 8 KiB of each one's log into the phase's output."""
    import tempfile
    import urllib.request

    rundir = Path(tempfile.mkdtemp(prefix="gpu-check-ipc-"))
    addr = ["--input-addr", f"ipc://{rundir / 'in'}", "--output-addr", f"ipc://{rundir / 'out'}"]
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    worker_cmd = [sys.executable, "-m", "engine_worker", *addr, *engine]
    proxy_cmd = [sys.executable, "-m", "proxy", *addr, "--host", "127.0.0.1", "--port", str(port)]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    outs = []
    try:
        for role, cmd in (("worker", worker_cmd), ("proxy", proxy_cmd)):
            outs.append((logs / f"run-{name}-{role}.log").open("wb"))
            procs[role] = subprocess.Popen(
                cmd, stdout=outs[-1], stderr=subprocess.STDOUT, start_new_session=True
            )
        t0 = time.monotonic()
        ready = False
        while time.monotonic() - t0 < wait_s and not ready:
            for role, p in procs.items():
                if p.poll() is not None:
                    res.metrics["ready_s"] = round(time.monotonic() - t0, 1)
                    raise RuntimeError(f"{role} exited with {p.returncode} before /ready")
            try:
                with urllib.request.urlopen(base + "/ready", timeout=2) as r:
                    ready = r.status == 200
            except OSError:
                time.sleep(0.5)
        res.metrics["ready_s"] = round(time.monotonic() - t0, 1)
        yield base if res.check("ready", ready) else None
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for out in outs:
            out.close()
        shutil.rmtree(rundir, ignore_errors=True)
        for role in ("worker", "proxy"):
            # into this phase's output, which is the command's log in the output folder
            print(f"---- {role} (last 8 KiB)\n{_tail(logs / f'run-{name}-{role}.log', 8192)}", flush=True)


def _engine_args(model_dir: Path) -> list[str]:
    """The worker's engine options of the HTTP phases: ``_settings`` as flags."""
    return [
        "--backend", "exllamav3", "--model-dir", str(model_dir), "--draft-mode", "ngram",
        "--max-seq-len", "4096", "--cache-size", "16384", "--chunk-size", "256",
    ]  # fmt: skip


def phase_proxy(work: Path, res: Result, worker_args: list[str] | None = None) -> None:
    """Worker and proxy as processes, over HTTP. ``worker_args`` replaces the worker's
    engine options (tests run this phase on the synthetic engine)."""
    with served(work, res, worker_args or _engine_args(work / "model"), "proxy") as base:
        if base is None:
            return
        prompt = "Fresh prompt. " + CHAT_PROMPT
        first = stream_chat(base, prompt, 64)
        prog = [p["processed"] for p in first["progress"]]
        usage = first["usage"] or {}
        total = usage.get("prompt_tokens")
        res.metrics.update(
            {"ttft_s": round(first["ttft_s"] or 0.0, 4), "itl_s": first["itl_s"] and round(first["itl_s"], 5)}
        )
        res.check(
            "progress_rises_to_total",
            first["error"] is None and len(prog) >= 4 and prog == sorted(set(prog)) and prog[-1] == total,
            progress_chunks=len(prog),
        )
        again = stream_chat(base, prompt, 8)
        cached = ((again["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        res.check(
            "repeat_reuses_prefix",
            isinstance(cached, int) and isinstance(total, int) and cached >= total - 256,
            cached_tokens_repeat=cached,
        )
        status, body = _post(base, "/v1/completions", {"prompt": "word " * 6000, "max_tokens": 4})
        res.check(
            "context_400",
            status == 400 and (body.get("error") or {}).get("code") == "context_length_exceeded",
            context_status=status,
        )


# ---------------------------------------------------------------- images, over HTTP


def picture(seed: int) -> str:
    """A base64 PNG of ``IMAGE_SIDE`` square pixels, a different pattern per ``seed``."""
    import io
    import random

    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (IMAGE_SIDE, IMAGE_SIDE), rng.randbytes(IMAGE_SIDE * IMAGE_SIDE * 3))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def image_turn(dialect: str, image: str, before: str, after: str) -> tuple[str, dict[str, Any]]:
    """``(path, body)``: one user turn of ``before``, the PNG ``image`` and ``after``, in
    ``dialect`` (``chat``, ``responses`` or ``messages``), answering at most 4 tokens."""
    url = f"data:image/png;base64,{image}"
    if dialect == "chat":
        parts = [
            {"type": "text", "text": before},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": after},
        ]
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}], "max_tokens": 4}
    if dialect == "responses":
        parts = [
            {"type": "input_text", "text": before},
            {"type": "input_image", "image_url": url},
            {"type": "input_text", "text": after},
        ]
        return "/v1/responses", {"input": [{"role": "user", "content": parts}], "max_output_tokens": 4}
    source = {"type": "base64", "media_type": "image/png", "data": image}
    parts = [
        {"type": "text", "text": before},
        {"type": "image", "source": source},
        {"type": "text", "text": after},
    ]
    return "/v1/messages", {"messages": [{"role": "user", "content": parts}], "max_tokens": 4}


def prompt_and_cached(path: str, body: dict[str, Any]) -> tuple[int | None, int | None]:
    """``(prompt tokens, cached tokens)`` of a response body, in its dialect's terms
    (Anthropic's ``input_tokens`` leaves out ``cache_read_input_tokens``)."""
    usage = body.get("usage") or {}
    if path == "/v1/chat/completions":
        return usage.get("prompt_tokens"), (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if path == "/v1/responses":
        return usage.get("input_tokens"), (usage.get("input_tokens_details") or {}).get("cached_tokens")
    read = usage.get("cache_read_input_tokens")
    total = usage.get("input_tokens")
    return (total + read if isinstance(total, int) and isinstance(read, int) else None), read


def phase_images(work: Path, res: Result) -> None:
    """The Qwen2.5-VL of ``write_vision_model`` served over HTTP: its vision component is
    loaded and announced; a picture takes ``image_tokens_expected()`` prompt tokens in each
    dialect; the same picture again is read from the prefix cache past its end token, and
    another picture at the same place only up to its first row."""
    notes = CHAT_PROMPT.split(" Note ")
    quarter = max(4, len(notes) // 4)
    before = "Look at this picture. " + " Note ".join(notes[1 : 1 + quarter])
    after = "What does it show? " + " Note ".join(notes[1 + quarter : 1 + 2 * quarter])
    with served(work, res, _engine_args(work / "vision-model"), "images") as base:
        if base is None:
            return
        import urllib.request

        from engine_worker.options.exllamav3 import PAGE_SIZE  # the prefix cache matches whole pages

        with urllib.request.urlopen(base + "/props", timeout=10) as r:
            props = json.loads(r.read())
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
            card = json.loads(r.read())["data"][0]
        res.check(
            "vision_served",
            (props.get("modalities") or {}).get("vision") is True
            and "image" in (card.get("architecture") or {}).get("input_modalities", []),
        )
        red = picture(1)
        path, chat = image_turn("chat", red, before, after)
        status, tok = _post(base, "/tokenize", {"messages": chat["messages"]})
        ids = tok.get("tokens") or []
        cfg = json.loads((work / "vision-model" / "config.json").read_text())
        rows = [i for i, t in enumerate(ids) if t >= cfg["vocab_size"]]
        if not rows:
            raise RuntimeError(f"/tokenize {status}: no image rows in {len(ids)} tokens: {str(tok)[:300]}")
        first, end = rows[0], rows[-1] + 1  # end: the index of the image's end token
        placed = (
            rows == list(range(first, end))
            and ids[first - 1] == cfg["vision_start_token_id"]
            and ids[end] == cfg["vision_end_token_id"]
        )
        res.metrics.update({"image_tokens": len(rows) + 2, "image_first_row": first, "image_end": end})
        expected = image_tokens_expected()
        for dialect, image in (("chat", red), ("responses", picture(2)), ("messages", picture(3))):
            path, body = image_turn(dialect, image, before, after)
            status, answer = _post(base, path, body)
            total, _ = prompt_and_cached(path, answer)
            res.check(
                f"image_{dialect}",
                status == 200 and placed and len(rows) + 2 == expected and total == len(ids),
                **{f"image_{dialect}_status": status, f"image_{dialect}_prompt_tokens": total},
            )
        path, body = image_turn("chat", red, before, after)
        status, answer = _post(base, path, body)
        _, cached = prompt_and_cached(path, answer)
        res.check(
            "image_repeat_cached",
            status == 200 and isinstance(cached, int) and cached > end,
            image_repeat_cached_tokens=cached,
        )
        path, body = image_turn("chat", picture(4), before, after)
        status, answer = _post(base, path, body)
        _, cached = prompt_and_cached(path, answer)
        res.check(
            "image_other_not_cached_past_start",
            status == 200 and isinstance(cached, int) and first // PAGE_SIZE * PAGE_SIZE <= cached <= first,
            image_other_cached_tokens=cached,
        )


PHASE_FUNCS: dict[str, Callable[[Path, Result], None]] = {
    "env": phase_env,
    "restore_ext": phase_restore_ext,
    "build_ext": phase_build_ext,
    "reimport": phase_reimport,
    "pack_ext": phase_pack_ext,
    "model": phase_model,
    "warm": phase_warm,
    "backend": phase_backend,
    "proxy": phase_proxy,
    "images": phase_images,
}


def run_phase(name: str, work: Path, result: Path) -> int:
    """A child's body: run one phase and write its result JSON, also when it fails."""
    res = Result()
    error = None
    try:
        PHASE_FUNCS[name](work, res)
    except Exception as e:
        import traceback

        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"[:1000]
    result.write_text(json.dumps({"checks": res.checks, "metrics": res.metrics, "error": error}, default=str))
    return 1 if error else 0


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="gpu_check.py")
    sub = ap.add_subparsers(dest="command", required=True)
    for command, phases in COMMANDS.items():
        p = sub.add_parser(command, help=f"phases: {', '.join(ph.name for ph in phases)}")
        p.add_argument(
            "--budget", type=float, default=DEFAULT_BUDGET[command], help="Seconds for all phases together."
        )
        p.add_argument(
            "--out",
            type=Path,
            default=Path(os.environ["OUT"]) if os.environ.get("OUT") else WORK / "out",
            help="Where the summary and logs go (default: $OUT, else build/gpu-check/out).",
        )
        p.add_argument("--work", type=Path, default=WORK, help="Model, logs and results (git-ignored).")
        p.add_argument(
            "--only",
            default=None,
            help="Comma-separated phases to run (needs on phases left out are not checked).",
        )
    ph = sub.add_parser("phase", help="(internal) run one phase in this process")
    ph.add_argument("name", choices=sorted(PHASE_FUNCS))
    ph.add_argument("--work", type=Path, required=True)
    ph.add_argument("--result", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.command != "phase":
        if args.budget <= 0:
            ap.error("--budget must be positive")
        if args.only is not None:
            names = [n.strip() for n in args.only.split(",") if n.strip()]
            known = {p.name for p in COMMANDS[args.command]}
            unknown = [n for n in names if n not in known]
            if unknown or not names:
                ap.error(f"--only: unknown phase(s) {unknown or names} for {args.command}: {sorted(known)}")
            args.only = names
    return args


def select(command: str, only: list[str] | None) -> tuple[Phase, ...]:
    phases = COMMANDS[command]
    if only is None:
        return phases
    kept = [p for p in phases if p.name in only]
    return tuple(
        Phase(p.name, p.timeout_s, p.min_s, tuple(n for n in p.needs if n in only), p.argv) for p in kept
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "phase":
        return run_phase(args.name, args.work, args.result)
    runner = Runner(args.command, select(args.command, args.only), args.budget, args.work, args.out)
    summary = runner.run()
    print(json.dumps({k: summary[k] for k in ("command", "ok", "total_s", "checks")}, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
