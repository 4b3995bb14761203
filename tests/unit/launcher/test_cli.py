"""``exl3-sidecar``: the subcommands reach the right process's own option parser."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from launcher.cli import main

EXL3_SIDECAR = [sys.executable, "-m", "launcher"]


def test_worker_is_the_worker_commands_own_parser() -> None:
    out = subprocess.run([*EXL3_SIDECAR, "worker", "--help"], capture_output=True, text=True, check=True)
    assert "--chunk-size" in out.stdout and "--check" in out.stdout and "--port" not in out.stdout
    assert out.stdout.startswith("Usage: exl3-sidecar worker [OPTIONS]")  # named as it was called
    bad = subprocess.run(
        [*EXL3_SIDECAR, "worker", "--check", "--dtype", "int8"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--dtype" in bad.stderr
    assert "Try 'exl3-sidecar worker --help'" in bad.stderr


def test_proxy_is_the_proxy_commands_own_parser() -> None:
    r = CliRunner().invoke(main, ["proxy", "--help"])
    assert r.exit_code == 0 and "--sse-ping-interval" in r.output and "--chunk-size" not in r.output


def test_serve_checks_worker_options_before_starting_anything() -> None:
    # A port that is surely taken would fail later; a bad worker option fails first.
    r = subprocess.run(
        [*EXL3_SIDECAR, "serve", "--port", "1", "--draft-mode", "mtp"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "draft_mode=mtp needs backend=exllamav3" in r.stderr
    assert "proxy listening" not in r.stderr
    # The usage line names the command the user typed, not the worker's module.
    assert "Usage: exl3-sidecar serve" in r.stderr and "engine_worker" not in r.stderr


def test_serve_takes_llama_cpp_and_vllm_flags_for_the_worker() -> None:
    r = subprocess.run(
        [*EXL3_SIDECAR, "serve", "--port", "1", "-c", "1", "--parallel", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    # Both reached the worker's own option (its range check names the alias as typed).
    assert r.returncode == 2 and "'-c'" in r.stderr and "x>=2" in r.stderr, r.stderr


def test_serve_refuses_a_bad_proxy_option() -> None:
    r = CliRunner().invoke(main, ["serve", "--port", "70000"])
    assert r.exit_code == 2 and "--port" in r.output


def test_serve_help_lists_proxy_options_and_points_to_the_worker() -> None:
    r = CliRunner().invoke(main, ["serve", "--help"])
    assert "--shutdown-drain" in r.output and "exl3-sidecar worker --help" in r.output


def test_serve_refuses_an_unreadable_key_file_before_starting_anything(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["serve", "--api-key-file", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "api_key_file" in r.output and "Traceback" not in r.output


def test_a_port_in_use_is_one_line_and_exit_1() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        r = subprocess.run(
            [*EXL3_SIDECAR, "serve", "--port", port, "--backend", "synthetic"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"cannot listen on 127.0.0.1:{port} (host, port)" in r.stderr
