"""The worker container's probes, run as the kubelet runs them, restart a hung worker.

``Kubelet`` plays the kubelet's part for one container, from the CPU overlay's own
manifest: it starts the worker (the synthetic backend, with the pod's heartbeat file),
runs the startup probe's command every ``periodSeconds`` until it passes (at most
``failureThreshold`` tries), then the liveness probe's; after ``failureThreshold``
consecutive liveness failures it kills the container as the kubelet does (the preStop
hook, cut at the probe's ``terminationGracePeriodSeconds``; SIGTERM; SIGKILL after what
is left of that grace, at least 2 s: kuberuntime_container.go, killContainer and
minimumGracePeriodInSeconds) and starts it again. A real proxy sits beside it, as in the
pod. The test SIGSTOPs the worker and measures the seconds until the proxy serves again
from a fresh worker.

Every period, threshold and age from the manifest is multiplied by ``SCALE``
(``$KUBELET_TIME_SCALE``, 0.2 by default so that CI spends ~10 s; 1 reproduces the
manifest's real timing, the figure in docs/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.integration.synthetic import served_proxy
from tests.unit.deploy.support import OVERLAYS, containers, model_server, rendered, settings_of

SCALE = float(os.environ.get("KUBELET_TIME_SCALE", "0.2"))
MIN_GRACE_S = 2.0
"""The kubelet's minimumGracePeriodInSeconds: SIGTERM to SIGKILL, at least."""
ROOT = Path(__file__).resolve().parents[2]


def _scaled_command(command: list[str]) -> list[str]:
    """The probe command with Python as this interpreter and its seconds scaled."""
    assert command[:3] == ["python", "-m", "engine_worker.probe"]
    out = [sys.executable, *command[1:]]
    for i, word in enumerate(out[:-1]):
        if word in ("--max-age", "--max-step", "--timeout"):
            out[i + 1] = str(float(out[i + 1]) * SCALE)
    return out


class Kubelet:
    """One container's life under the kubelet: start, startup probe, liveness probe, kill, restart."""

    def __init__(self, container: dict[str, Any], argv: list[str], env: dict[str, str]):
        self.startup = container["startupProbe"]
        self.liveness = container["livenessProbe"]
        self.pre_stop = _scaled_command(container["lifecycle"]["preStop"]["exec"]["command"])
        self.argv, self.env = argv, env
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.events: list[tuple[float, str]] = []

    def proxy_port(self, port: int) -> None:
        """Where the proxy beside it listens (its preStop waits on that port)."""
        self.pre_stop[self.pre_stop.index("--port") + 1] = str(port)

    def _log(self, what: str) -> None:
        self.events.append((time.monotonic(), what))

    async def _probe(self, spec: dict[str, Any]) -> bool:
        p = await asyncio.create_subprocess_exec(
            *_scaled_command(spec["exec"]["command"]), env=self.env, stdout=asyncio.subprocess.DEVNULL
        )
        try:
            async with asyncio.timeout(spec.get("timeoutSeconds", 1)):  # not scaled: a real exec's cost
                return await p.wait() == 0
        except TimeoutError:
            p.kill()
            await p.wait()
            return False

    async def _kill(self) -> None:
        assert self.proc is not None
        grace = self.liveness.get("terminationGracePeriodSeconds", 30) * SCALE
        started = time.monotonic()
        hook = await asyncio.create_subprocess_exec(*self.pre_stop, env=self.env)
        try:
            async with asyncio.timeout(grace):
                await hook.wait()
        except TimeoutError:
            hook.kill()
            await hook.wait()
        left = max(grace - (time.monotonic() - started), MIN_GRACE_S * SCALE)
        self.proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(left):
                await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        self._log("killed")

    async def run(self) -> None:
        while True:
            self.proc = await asyncio.create_subprocess_exec(*self.argv, env=self.env)
            self._log("started")
            for spec, phase in ((self.startup, "startup"), (self.liveness, "liveness")):
                failures = 0
                while failures < spec["failureThreshold"]:
                    await asyncio.sleep(spec["periodSeconds"] * SCALE)
                    if await self._probe(spec):
                        failures = 0
                        if phase == "startup":
                            self._log("started up")
                            break
                    else:
                        failures += 1
                if failures >= spec["failureThreshold"]:
                    self._log(f"{phase} failed")
                    break
            await self._kill()
            self.restarts += 1


async def test_a_frozen_worker_is_restarted_by_its_liveness_probe(tmp_path: Path) -> None:
    (cpu,) = [o for o in OVERLAYS if o.name == "cpu"]
    deployment = model_server(rendered(cpu))
    worker, proxy = containers(deployment)["worker"], containers(deployment)["proxy"]
    ws, ps = settings_of(worker), settings_of(proxy)
    addrs = f"ipc://{tmp_path}/in.sock", f"ipc://{tmp_path}/out.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("EXL3_SIDECAR_")} | {
        "PYTHONPATH": str(ROOT),
        "EXL3_SIDECAR_HEARTBEAT_FILE": str(tmp_path / Path(str(ws.heartbeat_file)).name),
        "EXL3_SIDECAR_INPUT_ADDR": addrs[0],
        "EXL3_SIDECAR_OUTPUT_ADDR": addrs[1],
        "EXL3_SIDECAR_HEARTBEAT_INTERVAL": str(ws.heartbeat_interval * SCALE),
    }
    argv = [sys.executable, "-m", "engine_worker", "--backend", "synthetic"]
    live = worker["livenessProbe"]
    kubelet = Kubelet(worker, argv, env)
    task = asyncio.create_task(kubelet.run())
    async with served_proxy(addrs, heartbeat_timeout=ps.heartbeat_timeout * SCALE) as url:
        kubelet.proxy_port(int(url.rsplit(":", 1)[1]))
        try:
            async with httpx.AsyncClient(timeout=5) as c:

                async def serving() -> str | None:
                    r = await c.get(url + "/ready")
                    return r.json().get("model") if r.status_code == 200 else None

                async def wait(cond: Any, limit: float, what: str) -> float:
                    start = time.monotonic()
                    while not await cond():
                        assert time.monotonic() - start < limit, (
                            f"{what} not within {limit:.1f} s: {kubelet.events}"
                        )
                        await asyncio.sleep(0.05)
                    return time.monotonic() - start

                await wait(serving, 60, "first readiness")
                await wait(lambda: _async(any(e == "started up" for _, e in kubelet.events)), 30, "startup")
                assert kubelet.proc is not None
                old = kubelet.proc
                old.send_signal(signal.SIGSTOP)
                stopped = time.monotonic()
                # The bound from the manifest: the beat ages past --max-age, then up to
                # failureThreshold periods of failures, the kill, and a fresh start.
                max_age = float(live["exec"]["command"][live["exec"]["command"].index("--max-age") + 1])
                bound = (
                    max_age + live["periodSeconds"] * (live["failureThreshold"] + 1)
                    + live["terminationGracePeriodSeconds"] + MIN_GRACE_S
                    + worker["startupProbe"]["periodSeconds"] * 2
                ) * SCALE + 10  # unscaled: Python starts and a synthetic load on a busy core  # fmt: skip
                await wait(lambda: _async(old.returncode is not None), bound, "the frozen worker killed")
                killed = time.monotonic() - stopped
                await wait(lambda: _async(kubelet.proc is not old), 5, "a new worker")
                await wait(serving, bound, "serving again")
                again = time.monotonic() - stopped
                print(
                    f"SIGSTOP -> killed {killed:.1f} s, -> serving again {again:.1f} s (time scale {SCALE:g})"
                )
                assert kubelet.restarts == 1
                assert killed >= max_age * SCALE, "killed before its beat was older than --max-age"
                assert again <= bound
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if kubelet.proc is not None and kubelet.proc.returncode is None:
                kubelet.proc.kill()
                await kubelet.proc.wait()


async def _async(value: bool) -> bool:
    return value
