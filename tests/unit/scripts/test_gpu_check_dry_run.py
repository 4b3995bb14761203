"""The GPU check's one command, run here: ``bash scripts/gpu_check.sh all --dry-run`` over
the stand-ins of ``tests/fakes/gpu_standin/`` (an ``nvcc``, CUDA in torch, an
``exllamav3`` over the fake engine), each "machine" a set of fresh folders. Every phase
runs; then a kill in the middle of the build (what the device tool does at its timeout),
the same command going on from the objects left, the built library's pieces restored on a
fresh machine instead of a build, and the stand-ins failing where the real tools would."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine_worker.options.exllamav3 import PAGE_SIZE
from scripts import gpu_check

ROOT = Path(gpu_check.__file__).resolve().parents[1]
ENTRY = ROOT / "scripts" / "gpu_check.sh"
CORES = len(os.sched_getaffinity(0))
SOURCES = 12  # the stand-in exllamav3_ext's translation units

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake engine's tokenizer files (``write_hf_tokenizer``): the model phase's vocabulary."""
    from tests.fakes import exllamav3 as fx

    d = tmp_path_factory.mktemp("tokenizer")
    fx.write_hf_tokenizer(str(d))
    return d


class Machine:
    """One GPU machine's worth of folders (output, work, site, build, Triton cache, carried
    pieces) and the environment the device tool's command would start with."""

    def __init__(self, base: Path, tokenizer: Path) -> None:
        self.base = base
        self.out = base / "out"
        self.carried = base / "carried"
        self.standin_log = base / "standin.log"
        self.env = {
            "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
            "HOME": str(base),
            "OUT": str(self.out),
            "GPU_CHECK_WORK": str(base / "work"),
            "GPU_CHECK_SITE": str(base / "site"),
            "TORCH_EXTENSIONS_DIR": str(base / "torch_extensions"),
            "TRITON_CACHE_DIR": str(base / "triton"),
            "GPU_CHECK_CARRIED_EXT": str(self.carried),
            "GPU_CHECK_TOKENIZER": str(tokenizer),
            "GPU_CHECK_PROMPT_NOTES": "20",  # the byte tokenizer: about 1,500 tokens
            "GPU_CHECK_STANDIN_LOG": str(self.standin_log),
        }

    def argv(self, *args: str) -> list[str]:
        return ["bash", str(ENTRY), "all", "--dry-run", *args]

    def run(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args), env={**self.env, **env}, capture_output=True, text=True, timeout=240
        )

    def summary(self) -> dict[str, Any]:
        return dict(json.loads((self.out / "gpu_check_all.json").read_text()))

    def phases(self) -> dict[str, dict[str, Any]]:
        return {p["name"]: p for p in self.summary()["phases"]}

    def compiles(self) -> list[str]:
        text = self.standin_log.read_text() if self.standin_log.exists() else ""
        return [line for line in text.splitlines() if line.startswith("nvcc ")]

    def log(self) -> str:
        return (self.out / gpu_check.LOG_NAME).read_text()


@pytest.fixture(scope="module")
def full(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: Path
) -> tuple[Machine, subprocess.CompletedProcess[str]]:
    machine = Machine(tmp_path_factory.mktemp("machine"), tokenizer)
    return machine, machine.run()


def test_the_one_command_runs_every_phase(full: tuple[Machine, subprocess.CompletedProcess[str]]) -> None:
    m, proc = full
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = m.summary()
    assert summary["ok"] is True and tuple(summary) == gpu_check.SUMMARY_KEYS
    assert [p["name"] for p in summary["phases"]] == [p.name for p in gpu_check.COMMANDS["all"]]
    assert {p["status"] for p in summary["phases"]} == {"ok"}
    metrics = summary["metrics"]
    # MAX_JOBS is the machine's cores; every source compiled once, that many at a time
    assert metrics["env.MAX_JOBS"] == str(CORES) and f"build MAX_JOBS={CORES} objects={SOURCES}" in (
        m.standin_log.read_text()
    )
    assert len(m.compiles()) == SOURCES and metrics["build_ext.objects_built"] == SOURCES
    assert metrics["build_ext.restored"] is False and metrics["pack_ext.packed"] is True
    # Triton's kernels went to TRITON_CACHE_DIR during the warm-up, before the scenarios
    assert metrics["warm.triton_cache_files_before"] == 0 and metrics["warm.triton_cache_files"] == 1
    assert metrics["proxy.cached_tokens_repeat"] > 0 and "proxy_minus_backend.ttft_s" in metrics
    # the reasoning-parity scenarios ran on the engine (here the fake one) and passed
    checks = m.phases()["backend"]["checks"]
    assert checks["grammar_after_thinking"] is True and checks["harmony_call"] is True
    assert metrics["backend.answer"] == "ok" and metrics["backend.harmony_calls"] == [
        ["get_weather", '{"city":"Paris"}']
    ]
    for phase in gpu_check.COMMANDS["all"]:
        assert f"==== [gpu_check] {phase.name} " in m.log()


def test_the_image_scenarios_ran_in_every_dialect(
    full: tuple[Machine, subprocess.CompletedProcess[str]],
) -> None:
    m, _ = full
    images = m.phases()["images"]
    assert images["status"] == "ok" and set(images["checks"]) == {
        "ready",
        "vision_served",
        "image_chat",
        "image_responses",
        "image_messages",
        "image_repeat_cached",
        "image_other_not_cached_past_start",
    }
    metrics = images["metrics"]
    # 56 x 56 pixels, 14-pixel patches merged 2 x 2: 4 rows, then the start and end tokens
    assert metrics["image_tokens"] == (56 // 14) ** 2 // 4 + 2 == 6
    first, end = metrics["image_first_row"], metrics["image_end"]
    assert end - first == 4 and first > PAGE_SIZE  # a whole page of text before it
    total = metrics["image_chat_prompt_tokens"]
    assert total > end
    assert metrics["image_responses_prompt_tokens"] == metrics["image_messages_prompt_tokens"] == total
    # the same picture: everything but the last prompt token; another: up to its first row
    assert end < metrics["image_repeat_cached_tokens"] < total
    assert metrics["image_other_cached_tokens"] == first  # the fake engine matches token by token
    assert m.phases()["model"]["checks"]["vision_model_written"] is True


@pytest.mark.parametrize(
    ("knob", "failed"),
    [
        (
            {"GPU_CHECK_STANDIN_IMAGE_EXTRA_ROWS": "1"},
            {"image_chat", "image_responses", "image_messages"},
        ),
        ({"GPU_CHECK_STANDIN_VISION_LOAD": "fails"}, None),
    ],
    ids=["image_too_long", "vision_load_fails"],
)
def test_a_wrong_vision_component_fails_the_image_checks(
    tmp_path: Path, tokenizer: Path, knob: dict[str, str], failed: set[str] | None
) -> None:
    m = Machine(tmp_path, tokenizer)
    proc = m.run("--only", "model,images", **knob)
    assert proc.returncode == 1, proc.stdout[-3000:]
    images = m.phases()["images"]
    assert images["status"] == "failed"
    if failed is None:  # the worker exits before /ready: no scenario runs
        assert images["checks"] == {} and "worker exited with" in images["error"]
        assert "the vision component failed to load" in m.log()
    else:
        assert {name for name, ok in images["checks"].items() if not ok} == failed
        assert images["metrics"]["image_tokens"] == 6 + 2  # two rows more: 2 x 3 rows of 28 pixels


def test_what_comes_back_fits_the_device_tool(full: tuple[Machine, subprocess.CompletedProcess[str]]) -> None:
    """At most 8 plain files, none in a folder, each under 16 MiB, named in letters, digits,
    '.', '_' and '-': summary, log, manifest and the library's pieces."""
    m, _ = full
    files = sorted(p.name for p in m.out.iterdir())
    assert all((m.out / f).is_file() for f in files) and len(files) <= 8
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files)
    assert all((m.out / f).stat().st_size < 16 * 2**20 for f in files)
    assert files == [
        "exllamav3_ext.manifest.json",
        "exllamav3_ext.so.gz.00",
        "gpu_check.log",
        "gpu_check_all.json",
    ]


def test_a_kill_mid_build_leaves_summary_and_log_and_the_command_goes_on(
    tmp_path: Path, tokenizer: Path
) -> None:
    m = Machine(tmp_path, tokenizer)
    slow = {**m.env, "GPU_CHECK_STANDIN_COMPILE_S": "0.4", "MAX_JOBS": "1"}
    proc = subprocess.Popen(
        m.argv("--only", "build_ext,reimport"),
        env=slow,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while len(m.compiles()) < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
    finally:
        _kill_session(proc.pid)  # the device tool's timeout: the command's session goes at once
        proc.wait()
    ext = Path(m.env["TORCH_EXTENSIONS_DIR"]) / "exllamav3_ext"
    # the objects on disk, not the log: the kill can land between an object's rename and its log line
    done = len(list(ext.glob("*.cuda.o")))
    assert 3 <= done < SOURCES
    phases = m.phases()
    assert phases["build_ext"]["status"] == "running" and "reimport" not in phases
    assert f"building {SOURCES} of {SOURCES} objects" in m.log() and "compiled kernel_00.cu" in m.log()
    assert (ext / "lock").exists()  # torch's lock, left by the killed build

    again = m.run("--only", "build_ext,reimport")
    assert again.returncode == 0, again.stdout[-3000:]
    phases = m.phases()
    assert phases["build_ext"]["metrics"]["stale_lock_removed"] is True
    assert phases["build_ext"]["metrics"]["objects_built"] == SOURCES
    assert phases["reimport"]["status"] == "ok"
    # the objects the killed build finished were not compiled again
    log = m.standin_log.read_text()
    second = log[log.rindex("build MAX_JOBS=") :]
    assert f"objects={SOURCES - done}" in second, (done, log)
    assert sum(line.startswith("nvcc ") for line in second.splitlines()) == SOURCES - done, (done, log)


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (phases run in process groups of their own)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(stat.parent.name), signal.SIGKILL)


def _carry(pieces_from: Path, to: Path) -> None:
    to.mkdir(parents=True)
    for f in pieces_from.glob("exllamav3_ext.*"):
        shutil.copy(f, to / f.name)


def test_a_fresh_machine_starts_from_the_pieces_instead_of_building(
    full: tuple[Machine, subprocess.CompletedProcess[str]], tmp_path: Path, tokenizer: Path
) -> None:
    built, _ = full
    m = Machine(tmp_path, tokenizer)
    _carry(built.out, m.carried)
    proc = m.run("--only", "restore_ext,build_ext,reimport,pack_ext")
    assert proc.returncode == 0, proc.stdout[-3000:]
    phases = m.phases()
    assert phases["restore_ext"]["checks"] == {"restored": True}
    assert (
        phases["build_ext"]["metrics"]["restored"] is True and phases["build_ext"]["metrics"]["build_s"] == 0
    )
    assert m.compiles() == []  # no compiler ran
    assert phases["reimport"]["checks"]["precompiled_module_loaded"] is True
    assert phases["pack_ext"]["metrics"]["packed"] is False
    site = "exllamav3_ext.so"
    assert (Path(m.env["GPU_CHECK_SITE"]) / site).read_bytes() == (
        Path(built.env["GPU_CHECK_SITE"]) / site
    ).read_bytes()
    assert not list(m.out.glob("exllamav3_ext.so.gz.*"))


def test_a_damaged_piece_is_refused_and_the_extension_built(
    full: tuple[Machine, subprocess.CompletedProcess[str]], tmp_path: Path, tokenizer: Path
) -> None:
    built, _ = full
    m = Machine(tmp_path, tokenizer)
    _carry(built.out, m.carried)
    piece = m.carried / "exllamav3_ext.so.gz.00"
    data = bytearray(piece.read_bytes())
    data[100] ^= 0xFF
    piece.write_bytes(bytes(data))
    proc = m.run("--only", "restore_ext,build_ext")
    assert proc.returncode == 1
    phases = m.phases()
    assert phases["restore_ext"]["status"] == "failed"
    assert "exllamav3_ext.so.gz.00 differs from the manifest" in phases["restore_ext"]["error"]
    assert phases["build_ext"]["status"] == "ok" and len(m.compiles()) == SOURCES


def test_without_an_arch_list_the_build_fails_as_the_real_one_and_what_needs_it_is_skipped(
    tmp_path: Path, tokenizer: Path
) -> None:
    m = Machine(tmp_path, tokenizer)
    proc = m.run("--only", "env,build_ext,reimport", TORCH_CUDA_ARCH_LIST="", TRITON_CACHE_DIR="")
    assert proc.returncode == 1
    phases = m.phases()
    assert phases["env"]["error"] == "checks failed: arch_list_set, triton_cache_dir_set"
    assert phases["build_ext"]["status"] == "skipped" and phases["reimport"]["status"] == "skipped"
    proc = m.run("--only", "build_ext", TORCH_CUDA_ARCH_LIST="")
    (rec,) = m.summary()["phases"]
    assert rec["status"] == "failed" and "Set TORCH_CUDA_ARCH_LIST" in rec["metrics"]["import_error"]
    assert m.compiles() == [] and "No CUDA device is visible" in m.log()


# ---------------------------------------------------------------- the pieces, in-process


def _env() -> dict[str, str]:
    return {"torch": "2.13.0", "torch_cuda": "13.0", "python": "3.12", "TORCH_CUDA_ARCH_LIST": "9.0"}


def test_pieces_split_under_the_limit_and_reassemble(tmp_path: Path) -> None:
    so = tmp_path / "exllamav3_ext.so"
    so.write_bytes(os.urandom(100_000))  # incompressible: 100,000 bytes and a gzip header
    manifest = gpu_check.pack_library(so, tmp_path / "out", _env(), piece_bytes=40_000)
    assert [p["bytes"] for p in manifest["pieces"]][:2] == [40_000, 40_000] and len(manifest["pieces"]) == 3
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        gpu_check.MANIFEST,
        *(f"exllamav3_ext.so.gz.0{i}" for i in range(3)),
    ]
    assert gpu_check.unpack_library(tmp_path / "out", _env()) == so.read_bytes()
    with pytest.raises(ValueError, match="built for another setup"):
        gpu_check.unpack_library(tmp_path / "out", {**_env(), "torch": "2.14.0"})
    (tmp_path / "out" / "exllamav3_ext.so.gz.01").unlink()
    with pytest.raises(ValueError, match=r"piece exllamav3_ext.so.gz.01 is missing"):
        gpu_check.unpack_library(tmp_path / "out", _env())


def test_a_library_too_large_for_the_output_folder_writes_no_piece(tmp_path: Path) -> None:
    so = tmp_path / "exllamav3_ext.so"
    so.write_bytes(os.urandom(5 * 1000))
    with pytest.raises(ValueError, match="needs 6 pieces"):
        gpu_check.pack_library(so, tmp_path / "out", _env(), piece_bytes=1000)
    assert not (tmp_path / "out").exists()


def test_the_phases_fit_one_device_call() -> None:
    phases = gpu_check.COMMANDS["all"]
    budget = gpu_check.DEFAULT_BUDGET["all"]
    assert budget <= 570 and sum(p.min_s for p in phases) < budget
    # the build may take all the budget leaves after the later phases' minimums
    build = next(i for i, p in enumerate(phases) if p.name == "build_ext")
    reserve = sum(p.min_s for p in phases[build + 1 :])
    assert phases[build].timeout_s <= budget - reserve - sum(p.min_s for p in phases[:build])
    # summary, log, manifest and the pieces: the device tool brings back 8 files
    assert 3 + gpu_check.MAX_PIECES <= 8 and gpu_check.PIECE_BYTES < 16 * 2**20
