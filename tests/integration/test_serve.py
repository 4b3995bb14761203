"""``exl3-sidecar serve`` as a process: supervision of a real worker child and
signal handling, with the synthetic engine or a worker that cannot load its model
(no model is loaded, so this runs in seconds)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs. An exited child whose parent died is a zombie
    until whatever adopted it reaps it (in a container, maybe never): it has
    exited all the same."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _wait_for(cond: object, timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen in {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def _serve(log: Path, *args: str, **env_extra: str) -> tuple[subprocess.Popen[bytes], int]:
    """``exl3-sidecar serve`` on a free loopback port with ``args``, its output in ``log``."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXL3_SIDECAR_")} | env_extra
    cmd = [sys.executable, "-m", "launcher", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    with log.open("wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env), port


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serve_restarts_a_worker_that_died_after_serving_and_stops_cleanly(
    tmp_path: Path, sig: signal.Signals
) -> None:
    log = tmp_path / "serve.log"
    proc, port = _serve(log, "--backend", "synthetic")
    try:
        for delay in ("2", "4"):  # it keeps dying soon after each start: the backoff doubles
            _wait_for(lambda: _ready(port), 60, "readiness", log)
            (worker,) = _children(proc.pid)
            os.kill(worker, signal.SIGKILL)
            _wait_for(lambda d=delay: f"restarting in {d} s" in log.read_text(), 30, "a restart", log)  # type: ignore[misc]
        r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
        assert r.status_code == 503
        proc.send_signal(sig)
        assert proc.wait(20) == 0
        assert _children(proc.pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("kind", ["missing", "gguf", "no-config"])
def test_serve_with_a_bad_model_path_exits_2_at_once(tmp_path: Path, kind: str) -> None:
    model = {"missing": tmp_path / "no-such-model", "gguf": tmp_path / "m.gguf", "no-config": tmp_path}[kind]
    if kind == "gguf":
        model.write_bytes(b"GGUF")
    log = tmp_path / "serve.log"
    started = time.monotonic()
    proc, _port = _serve(log, "--model-dir", str(model))
    try:
        assert proc.wait(30) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert f"--model-dir {model}" in text and "Usage: exl3-sidecar serve" in text, text
    assert "restarting in" not in text and "proxy listening" not in text
    assert time.monotonic() - started < 30


def test_serve_stops_when_its_worker_cannot_load_before_it_ever_served(tmp_path: Path) -> None:
    # Passes the checks on disk (config.json, a weights file), fails inside transformers.
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"not safetensors")
    log = tmp_path / "serve.log"
    proc, _port = _serve(log, "--model-dir", str(model))
    try:
        assert proc.wait(120) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert text.count("cannot load the model") == 1 and "before it served" in text, text
    assert "restarting in" not in text and _children(proc.pid) == []


def test_sigkill_of_serve_leaves_no_worker_and_no_socket_dir(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    # ipc:// paths must stay under ~107 bytes: a short runtime dir of our own.
    run = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    proc, port = _serve(log, "--backend", "synthetic", XDG_RUNTIME_DIR=str(run))
    try:
        _wait_for(lambda: _ready(port), 60, "readiness", log)
        (worker,) = _children(proc.pid)
        sockets = list((run / "exl3-sidecar").glob("serve-*"))
        assert len(sockets) == 1 and (sockets[0] / "input.sock").exists()
        proc.kill()
        proc.wait(5)
        deadline = time.monotonic() + 2
        while _running(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(worker), "the worker outlived a SIGKILLed serve by 2 s"
        assert not sockets[0].exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(run, ignore_errors=True)


def test_serve_restarts_a_hung_worker_and_clears_what_it_held(tmp_path: Path) -> None:
    """SIGSTOP the worker: within heartbeat_timeout serve kills it (SIGKILL, the
    one signal a stopped process acts on) and starts a fresh one, which holds
    none of the old one's requests; the proxy serves again."""
    log = tmp_path / "serve.log"
    run = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    timeout = 2.0
    proc, port = _serve(
        log, "--backend", "synthetic", "--heartbeat-timeout", str(timeout), XDG_RUNTIME_DIR=str(run)
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> dict[str, object] | None:
        try:
            r = httpx.get(url + "/ready", timeout=2)
        except httpx.TransportError:
            return None
        return r.json() if r.status_code == 200 else None  # type: ignore[no-any-return]

    try:
        _wait_for(ready, 60, "readiness", log)
        (hb_file,) = run.glob("exl3-sidecar/serve-*/worker.heartbeat")
        body = {"model": "m", "prompt": "hi", "max_tokens": 100_000, "stream": True}
        stream = httpx.Client(timeout=30)
        with stream, stream.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            _wait_for(lambda: (ready() or {}).get("worker_active_requests") == 1, 10, "running", log)
            (worker,) = _children(proc.pid)
            os.kill(worker, signal.SIGSTOP)
            stopped = time.monotonic()
            _wait_for(lambda: not _running(worker), 4 * timeout + 5, "the hung worker killed", log)
            killed = time.monotonic() - stopped
            text = "".join(r.iter_text())  # the lost request ends with an error event, not a hang
        assert "engine_dead" in text and text.rstrip().endswith("data: [DONE]")
        assert timeout <= killed <= timeout + 3, f"killed {killed:.1f} s after SIGSTOP"
        assert "worker hung" in log.read_text()
        _wait_for(lambda: _children(proc.pid) not in ([], [worker]), 20, "a new worker", log)
        _wait_for(lambda: (ready() or {}).get("worker_active_requests") == 0, 30, "the new worker", log)
        print(
            f"heartbeat_timeout {timeout:g} s: SIGSTOP -> killed {killed:.1f} s, -> serving again "
            f"{time.monotonic() - stopped:.1f} s"
        )
        assert hb_file.exists()
        assert httpx.get(url + "/health", timeout=2).status_code == 200
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(20)
        shutil.rmtree(run, ignore_errors=True)
