"""The worker's settings through its own command line (``python -m engine_worker``)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from engine_worker.cli import main
from engine_worker.settings import BACKEND_DEFAULTS, DraftMode, WorkerSettings
from protocol.settings import env_var, flag, from_options


def parse(*args: str) -> WorkerSettings:
    return from_options(WorkerSettings, main.make_context("worker", list(args)).params)


def test_per_backend_defaults_are_resolved_once() -> None:
    cpu = parse()
    assert (cpu.max_seq_len, cpu.chunk_size, cpu.num_draft_tokens) == (8192, 256, 4)
    assert cpu.ngram_match_max == 4 and cpu.draft_mode is DraftMode.NONE and cpu.drafting is None
    exl3 = parse("--backend", "exllamav3", "--model-dir", "/m")
    assert (exl3.max_seq_len, exl3.chunk_size, exl3.num_draft_tokens) == (None, 2048, None)
    assert BACKEND_DEFAULTS["cpu"]["chunk_size"] == 256  # the one place that default is written


def test_flags_env_vars_and_help_are_derived_for_every_option() -> None:
    help_text = CliRunner().invoke(main, ["--help"]).output
    for f in dataclasses.fields(WorkerSettings):
        expected = f"{flag(f.name)} / --no-" if f.type == "bool" else flag(f.name)
        assert expected in help_text, f.name
        assert env_var(f.name) in help_text.replace("\n", "").replace(" ", ""), f.name


def test_env_var_sets_a_value_and_the_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXL3_SIDECAR_CHUNK_SIZE", "64")
    monkeypatch.setenv("EXL3_SIDECAR_DRAFT_MODE", "ngram")
    monkeypatch.setenv("EXL3_SIDECAR_WARMUP", "false")
    s = parse()
    assert s.chunk_size == 64 and s.draft_mode is DraftMode.NGRAM and s.drafting == "ngram" and not s.warmup
    assert parse("--chunk-size", "128").chunk_size == 128


def test_ngram_match_max_follows_min_unless_given() -> None:
    assert parse("--ngram-match-min", "6").ngram_match_max == 6
    assert parse("--ngram-match-min", "2", "--ngram-match-max", "3").ngram_match_max == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--chunk-size", "0"], "--chunk-size"),
        (["--dtype", "int8"], "--dtype"),
        (["--max-seq-len", "1"], "--max-seq-len"),
        (["--prefix-cache-mb", "-1"], "--prefix-cache-mb"),
        (["--num-draft-tokens", "0"], "--num-draft-tokens"),
        (["--threads", "0"], "--threads"),
        (["--ngram-match-min", "3", "--ngram-match-max", "2"], "ngram_match_max"),
        (["--draft-mode", "mtp"], "draft_mode=mtp needs backend=exllamav3"),
        (["--backend", "exllamav3"], "model_dir"),
        (["--backend", "exllamav3", "--model-dir", "/m", "--chunk-size", "300"], "chunk_size=300"),
        (["--kv-events-topic", "kv@p@m"], "kv_events_topic needs kv_events_endpoint"),
        (
            ["--kv-events-replay-endpoint", "tcp://*:5558"],
            "kv_events_replay_endpoint needs kv_events_endpoint",
        ),
        (["--kv-events-connect"], "kv_events_connect needs kv_events_endpoint"),
        (
            ["--backend", "synthetic", "--kv-events-endpoint", "tcp://*:5557"],
            "synthetic engine publishes no KV-cache events",
        ),
        (["--no-such-option"], "No such option"),
    ],
)
def test_bad_values_are_one_line_usage_errors(args: list[str], message: str) -> None:
    r = CliRunner().invoke(main, ["--check", *args])
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def test_check_validates_without_loading_anything() -> None:
    code = (
        "import sys; from engine_worker.cli import main\n"
        "try:\n    main(['--check', '--draft-mode', 'ngram'])\nexcept SystemExit as e:\n    rc = e.code\n"
        "print(rc, sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'proxy')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "[]"]


@pytest.mark.parametrize(
    "bad",
    [
        {"dtype": "int8"},
        {"chunk_size": 0},
        {"max_seq_len": 1},
        {"prefix_cache_mb": -1},
        {"num_draft_tokens": 0},
        {"threads": 0},
        {"quantization": "int2"},
        {"heartbeat_interval": 0.0},
    ],
)
def test_direct_construction_rejects_out_of_range(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        WorkerSettings(**bad)


def test_settings_are_frozen() -> None:
    s = WorkerSettings(model_dir=Path("/m"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.chunk_size = 512  # type: ignore[misc]


def test_synthetic_backend_defaults_and_refusals() -> None:
    s = parse("--backend", "synthetic")
    assert (s.max_seq_len, s.chunk_size, s.max_batch_size) == (8192, 256, 1024)
    assert (s.synthetic_step_ms, s.synthetic_tokens_per_step) == (20.0, 1)
    r = CliRunner().invoke(main, ["--check", "--backend", "synthetic", "--draft-mode", "ngram"])
    assert r.exit_code == 2 and "does not draft" in r.output


def test_queue_and_batch_defaults() -> None:
    cpu = parse()
    assert (cpu.max_batch_size, cpu.max_queue, cpu.kv_cache_mb, cpu.parent_pid) == (16, 256, 4096, None)
    assert parse("--backend", "exllamav3", "--model-dir", "/m").max_batch_size is None  # the loader's


@pytest.mark.parametrize(
    ("args", "field", "value"),
    [
        (["-c", "4096"], "max_seq_len", 4096),  # llama.cpp
        (["--ctx-size", "4096"], "max_seq_len", 4096),  # llama.cpp
        (["--max-model-len", "2048"], "max_seq_len", 2048),  # vLLM
        (["-np", "4"], "max_batch_size", 4),  # llama.cpp
        (["--parallel", "4"], "max_batch_size", 4),  # llama.cpp
        (["--max-num-seqs", "8"], "max_batch_size", 8),  # vLLM
        (["-t", "2"], "threads", 2),  # llama.cpp
        (["-m", "/m"], "model_dir", Path("/m")),  # llama.cpp (a GGUF there is refused on disk)
        (["--model", "/m"], "model_dir", Path("/m")),  # vLLM, llama.cpp
        (["-ngl", "0"], "n_gpu_layers", "0"),
    ],
)
def test_other_servers_names_set_the_same_option(args: list[str], field: str, value: object) -> None:
    assert getattr(parse(*args), field) == value


def test_help_lists_the_aliases_beside_the_option() -> None:
    help_text = " ".join(CliRunner().invoke(main, ["--help"]).output.split())
    assert "-c, --max-seq-len, --ctx-size, --max-model-len INTEGER" in help_text
    assert "-m, --model-dir, --model PATH" in help_text
    assert "-np, --max-batch-size, --parallel, --max-num-seqs" in help_text
    assert "-ngl, --n-gpu-layers, --gpu-layers" in help_text


@pytest.mark.parametrize(
    ("flag_", "hint"),
    [
        ("--gpu-memory-utilization", "--cache-size"),
        ("--tensor-parallel-size", "--tensor-parallel"),
        ("--kv-cache-dtype", "--cache-mode"),
        ("--port", "a proxy option"),
    ],
)
def test_other_servers_flags_without_a_counterpart_are_refused_with_a_hint(flag_: str, hint: str) -> None:
    r = CliRunner().invoke(main, ["--check", flag_, "1"])
    assert r.exit_code == 2 and f"{flag_}: " in r.output and hint in r.output, r.output
    r = CliRunner().invoke(main, ["--check", f"{flag_}=1"])
    assert r.exit_code == 2 and hint in r.output


def test_a_misspelt_flag_suggests_the_option_an_alias_stands_for() -> None:
    r = CliRunner().invoke(main, ["--check", "--ctx-sise", "4096"])
    assert r.exit_code == 2 and "--ctx-size (= --max-seq-len)" in r.output
