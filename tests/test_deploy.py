"""The Kubernetes manifests and images agree with the code they run: every
environment variable is one the CLI reads, probes hit real routes, both
containers meet at the same sockets, the grace period outlasts the drain."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click
import yaml

from proxy.cli import main as cli

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def _containers() -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "deployment.yaml").read_text()))
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def _envvars_of(command: str) -> set[str]:
    cmd = cli.commands[command]  # type: ignore[attr-defined]
    return {p.envvar for p in cmd.params if isinstance(p, click.Option) and p.envvar}


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


def test_every_env_var_is_read_by_the_command_it_configures() -> None:
    c = _containers()
    assert set(_env(c["worker"])) <= _envvars_of("worker")
    assert set(_env(c["proxy"])) <= _envvars_of("proxy")


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


def test_grace_period_outlasts_the_drain() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "k8s" / "deployment.yaml").read_text()))
    spec = docs[0]["spec"]["template"]["spec"]
    drain = float(_env(_containers()["proxy"])["EXL3_SIDECAR_SHUTDOWN_DRAIN"])
    assert spec["terminationGracePeriodSeconds"] > drain


def test_images_run_existing_commands_and_the_proxy_image_has_no_torch() -> None:
    for dockerfile in (DEPLOY / "docker").glob("*.Dockerfile"):
        text = dockerfile.read_text()
        entry = re.search(r'ENTRYPOINT \["exl3-sidecar", "(\w+)"', text)
        assert entry and entry.group(1) in cli.commands, dockerfile.name  # type: ignore[attr-defined]
    proxy_image = (DEPLOY / "docker" / "proxy.Dockerfile").read_text()
    assert re.search(r"pip install --no-cache-dir \.\s", proxy_image), "proxy image must be the base install"
    assert "torch" not in proxy_image.split("FROM", 1)[1].replace("no torch", "")
