"""The Kubernetes manifests and images agree with the code they run: every
environment variable is one the container's command reads, probes hit real
routes, both containers meet at the same sockets, the grace period outlasts the
drain, and each image carries only its own process's package."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click
import yaml

from engine_worker.cli import main as worker_command
from launcher.cli import main as launcher
from proxy.cli import main as proxy_command

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _containers() -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "deployment.yaml").read_text()))
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def _envvars_of(cmd: click.Command) -> set[str]:
    return {p.envvar for p in cmd.params if isinstance(p, click.Option) and isinstance(p.envvar, str)}


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


def test_every_env_var_is_read_by_the_command_it_configures() -> None:
    c = _containers()
    assert set(_env(c["worker"])) <= _envvars_of(worker_command)
    assert set(_env(c["proxy"])) <= _envvars_of(proxy_command)


def test_worker_and_proxy_share_sockets_on_a_shared_volume() -> None:
    c = _containers()
    w, p = _env(c["worker"]), _env(c["proxy"])
    for key in ("EXL3_SIDECAR_INPUT_ADDR", "EXL3_SIDECAR_OUTPUT_ADDR"):
        assert w[key] == p[key]
        path = w[key].removeprefix("ipc://")
        mounts = [m for m in c["worker"]["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        (mount,) = mounts
        assert any(m["name"] == mount["name"] for m in c["proxy"]["volumeMounts"])


def test_probes_hit_routes_of_the_app() -> None:
    from aiohttp import web

    from proxy.handlers import add_routes

    app = web.Application()
    add_routes(app)
    paths = {r.resource.canonical for r in app.router.routes() if r.method == "GET" and r.resource}
    proxy = _containers()["proxy"]
    assert proxy["readinessProbe"]["httpGet"]["path"] in paths
    assert proxy["livenessProbe"]["httpGet"]["path"] in paths
    assert proxy["readinessProbe"]["httpGet"]["path"] != proxy["livenessProbe"]["httpGet"]["path"]


def test_proxy_listens_beyond_loopback_in_the_pod_and_the_image() -> None:
    """The proxy defaults to 127.0.0.1 (safe on a shared machine); the pod and
    the image must say 0.0.0.0 or the Service reaches nothing."""
    assert _env(_containers()["proxy"])["EXL3_SIDECAR_HOST"] == "0.0.0.0"
    proxy_image = (DEPLOY / "docker" / "proxy.Dockerfile").read_text()
    assert re.search(r"^ENV EXL3_SIDECAR_HOST=0\.0\.0\.0$", proxy_image, re.M)


def test_grace_period_outlasts_the_drain() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "deployment.yaml").read_text()))
    spec = docs[0]["spec"]["template"]["spec"]
    drain = float(_env(_containers()["proxy"])["EXL3_SIDECAR_SHUTDOWN_DRAIN"])
    assert spec["terminationGracePeriodSeconds"] > drain


def _copied(text: str) -> set[str]:
    return set(re.findall(r"^COPY (\w+) \./\1$", text, re.M))


def test_each_image_carries_its_own_process_and_runs_an_existing_command() -> None:
    proxy_image = (DEPLOY / "docker" / "proxy.Dockerfile").read_text()
    assert _copied(proxy_image) == {"protocol", "proxy", "launcher"}
    entry = re.search(r'ENTRYPOINT \["exl3-sidecar", "(\w+)"', proxy_image)
    assert entry and entry.group(1) in launcher.commands  # type: ignore[attr-defined]
    assert re.search(r"pip install --no-cache-dir \.\s", proxy_image), "proxy image must be the base install"
    assert "torch" not in proxy_image.split("FROM", 1)[1].replace("no torch", "")
    for name in ("worker-cpu.Dockerfile", "worker-exllamav3.Dockerfile"):
        text = (DEPLOY / "docker" / name).read_text()
        assert _copied(text) == {"protocol", "engine_worker"}, name
        assert 'ENTRYPOINT ["python", "-m", "engine_worker"' in text, name
