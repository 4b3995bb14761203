"""The GPU check's runner and its arguments: timeouts, budget, skips, the summary's shape,
the extension-build bookkeeping and the shell entry's environment. Every phase itself runs
in ``test_gpu_check_dry_run.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from scripts import gpu_check
from scripts.gpu_check import Phase, Runner

SCRIPTS = Path(gpu_check.__file__).resolve().parent


def _child(code: str) -> tuple[str, ...]:
    """A phase child running ``code`` with the result path as ``sys.argv[1]``."""
    return (sys.executable, "-c", code)


def _writes(checks: dict[str, bool], metrics: dict[str, Any] | None = None) -> tuple[str, ...]:
    data = json.dumps({"checks": checks, "metrics": metrics or {}, "error": None})
    return _child(f"import sys, pathlib; pathlib.Path(sys.argv[1]).write_text({data!r})")


def _runner(tmp_path: Path, phases: tuple[Phase, ...], budget: float = 60.0) -> Runner:
    return Runner("run", phases, budget, tmp_path / "work", tmp_path / "out")


def test_arguments_have_the_documented_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OUT", str(tmp_path))
    one = gpu_check.parse_args(["all"])
    assert (one.command, one.budget, one.out, one.only) == ("all", 570.0, tmp_path, None)
    run = gpu_check.parse_args(["all", "--budget", "200", "--only", "backend, proxy"])
    assert (run.budget, run.only) == (200.0, ["backend", "proxy"])
    monkeypatch.delenv("OUT")
    assert gpu_check.parse_args(["all"]).out == gpu_check.WORK / "out"
    # one device call of at most 600 s, with time for the wheels' install before it
    assert gpu_check.DEFAULT_BUDGET["all"] <= 600 - 30


@pytest.mark.parametrize(
    "argv",
    [["all", "--only", "import"], ["all", "--budget", "0"], ["build"], ["run"], ["all", "--only", ","]],
)
def test_bad_arguments_are_a_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(argv)
    assert e.value.code == 2


def test_only_drops_the_needs_on_phases_left_out() -> None:
    phases = gpu_check.select("all", ["proxy"])
    assert [(p.name, p.needs) for p in phases] == [("proxy", ())]
    phases = gpu_check.select("all", ["reimport", "model", "warm"])
    assert [(p.name, p.needs) for p in phases] == [
        ("reimport", ()),
        ("model", ()),
        ("warm", ("reimport", "model")),
    ]


def test_every_phase_has_a_child_and_its_own_timeout_within_the_budget() -> None:
    for command, phases in gpu_check.COMMANDS.items():
        assert sum(p.min_s for p in phases) < gpu_check.DEFAULT_BUDGET[command]
        for p in phases:
            assert p.name in gpu_check.PHASE_FUNCS and 0 < p.min_s <= p.timeout_s
            assert all(n in {q.name for q in phases} for n in p.needs)


def test_summary_shape_timeouts_and_skips(tmp_path: Path) -> None:
    phases = (
        Phase("first", 20, min_s=1, argv=_writes({"a": True}, {"ttft_s": 0.5})),
        Phase("hangs", 1.5, min_s=1, argv=_child("import time; time.sleep(60)")),
        Phase("after_hang", 20, min_s=1, needs=("hangs",), argv=_writes({"b": True})),
        Phase("independent", 20, min_s=1, needs=("first",), argv=_writes({"c": False})),
    )
    t0 = time.monotonic()
    summary = _runner(tmp_path, phases).run()
    assert time.monotonic() - t0 < 15  # the hang was cut at its own timeout
    on_disk = json.loads((tmp_path / "out" / "gpu_check_run.json").read_text())
    assert on_disk == summary
    assert tuple(summary) == gpu_check.SUMMARY_KEYS
    for rec in summary["phases"]:
        assert tuple(rec) == gpu_check.PHASE_KEYS and rec["status"] in gpu_check.STATUSES
    status = {r["name"]: (r["status"], r["error"]) for r in summary["phases"]}
    assert status["first"] == ("ok", None)
    assert status["hangs"][0] == "timeout" and "killed after" in status["hangs"][1]
    assert status["after_hang"] == ("skipped", "needs hangs, which did not pass")
    assert status["independent"] == ("failed", "checks failed: c")
    assert summary["checks"] == {"first.a": True, "independent.c": False}
    assert summary["metrics"]["first.ttft_s"] == 0.5
    assert summary["ok"] is False
    log = (tmp_path / "out" / gpu_check.LOG_NAME).read_text()
    assert "==== [gpu_check] hangs" in log and "[gpu_check] hangs: timeout" in log


def test_a_phase_is_skipped_when_the_budget_cannot_give_it_its_minimum(tmp_path: Path) -> None:
    phases = (
        Phase("slow", 10, min_s=0.5, argv=_child("import time; time.sleep(60)")),
        Phase("big", 60, min_s=30, argv=_writes({"x": True})),
        Phase("quiet", 60, min_s=0.1, argv=_child("pass")),
    )
    summary = _runner(tmp_path, phases, budget=31.1).run()
    slow, big, quiet = summary["phases"]
    # "slow" gets what the budget leaves after reserving the later phases' minimums
    assert (slow["timeout_s"], slow["status"]) == (1.0, "timeout")
    assert big["status"] == "skipped" and "budget left" in big["error"]
    assert (quiet["status"], quiet["error"]) == ("failed", "the phase wrote no result")


def test_a_crashing_child_is_a_failed_phase_with_its_log_tail(tmp_path: Path) -> None:
    phases = (Phase("crash", 20, min_s=1, argv=_child("print('boom here'); raise SystemExit(3)")),)
    (rec,) = _runner(tmp_path, phases).run()["phases"]
    assert rec["status"] == "failed" and "exit status 3" in rec["error"] and "boom here" in rec["error"]


def test_build_bookkeeping_counts_objects_and_clears_a_stale_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    d = tmp_path / gpu_check.EXT_NAME
    d.mkdir()
    for name in ("a.cuda.o", "b.o", "build.ninja"):
        (d / name).write_text("")
    (d / "lock").write_text("")
    assert gpu_check.PRE_HOOKS["build_ext"]()["stale_lock_removed"] is True
    assert not (d / "lock").exists()
    progress = gpu_check.TIMEOUT_HOOKS["build_ext"]()
    assert progress["objects_built"] == 2 and progress["extension_built"] is False
    assert "the same command on this machine goes on" in progress["note"]
    (d / f"{gpu_check.EXT_NAME}.so").write_text("")
    assert gpu_check.build_progress()["extension_built"] is True


def test_the_reimport_refuses_to_build_the_extension(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPU_CHECK_SITE", str(tmp_path))
    assert gpu_check.installed_module() == tmp_path / "exllamav3_ext.so"
    with pytest.raises(RuntimeError, match="did not install it"):
        gpu_check.phase_reimport(tmp_path, gpu_check.Result())


def test_latency_comparison() -> None:
    metrics = {"backend.ttft_s": 0.1, "proxy.ttft_s": 0.125, "backend.itl_s": 0.01, "proxy.itl_s": None}
    assert gpu_check.compare_latency(metrics) == {"proxy_minus_backend.ttft_s": 0.025}


def test_the_shell_entry_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPTS / "gpu_check.sh")], check=True)


def test_the_shell_entry_installs_the_wheels_once_and_sets_one_environment(tmp_path: Path) -> None:
    """Reinstalling would give exllamav3's sources new times, and another environment
    another ninja command line: either would rebuild the extension on a second call."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / "scripts" / "gpu_check.sh").write_text((SCRIPTS / "gpu_check.sh").read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.log"
    stub = bin_dir / "python3"
    shared = "TORCH_CUDA_ARCH_LIST|MAX_JOBS|TORCH_EXTENSIONS_DIR|TRITON_CACHE_DIR|PYTHONPATH"
    stub.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> {calls}\n'
        'if [ "$2" = pip ]; then\n'
        '  for a in "$@"; do [ "$prev" = --target ] && mkdir -p "$a"; prev=$a; done; exit 0\n'
        "fi\n"
        f'env | grep -E "^({shared})=" | sort >> {calls}\n'
    )
    stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path)}
    entry = str(root / "scripts" / "gpu_check.sh")
    missing = subprocess.run(["bash", entry, "all"], env=env, capture_output=True, text=True)
    assert missing.returncode == 2 and "no wheels in .whl/" in missing.stderr
    (root / ".whl").mkdir()
    (root / ".whl" / "exllamav3-1.6.5-py3-none-any.whl").write_text("")
    for _ in range(2):
        subprocess.run(["bash", entry, "all"], env=env, check=True)
    log = calls.read_text().splitlines()
    installs = [line for line in log if line.startswith("-m pip install")]
    assert len(installs) == 1 and "--no-deps" in installs[0] and "--no-index" in installs[0]
    runs = [line for line in log if line.startswith("scripts/gpu_check.py")]
    assert runs == ["scripts/gpu_check.py all", "scripts/gpu_check.py all"]
    envs = [line for line in log if "=" in line and not line.startswith(("-m", "scripts/"))]
    assert envs[: len(envs) // 2] == envs[len(envs) // 2 :]  # both calls saw the same
    assert f"TORCH_EXTENSIONS_DIR={root}/build/torch_extensions" in envs
    assert f"TRITON_CACHE_DIR={root}/build/triton-cache" in envs
    cores = len(os.sched_getaffinity(0))
    assert "TORCH_CUDA_ARCH_LIST=9.0" in envs and f"MAX_JOBS={cores}" in envs
