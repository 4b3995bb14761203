"""Each overlay's pod agrees with the code it runs: every environment variable is
an option of the process that reads it and parses with it, both processes meet at
the same sockets on a shared in-memory volume, probes and the scrape hit the
proxy's real handlers on its real port, the grace period outlasts preStop + drain,
the API keys come from a Secret, and the GPU and CPU overlays are what they say.

Each check is a function over a rendered overlay; ``test_a_broken_pod_fails``
breaks a copy of an overlay once per check, so every check is seen failing.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from pathlib import Path

import click
import pytest
from aiohttp import web

from protocol.settings import ENV_PREFIX
from proxy import handlers
from proxy.app import OPEN_PATHS
from proxy.state import ProxyState
from tests.unit.deploy.kustomize import Obj, split_image
from tests.unit.deploy.support import (
    OVERLAYS,
    container_port,
    containers,
    dockerfile_of,
    envvars_of,
    find,
    model_server,
    one,
    pod_spec,
    process_of,
    rel,
    rendered,
    settings_of,
)

Objs = list[Obj]

# None today: the worker image carries ExLlamaV3's extension precompiled, so it no
# longer needs TORCH_EXTENSIONS_DIR (a library variable) pointed at a writable place.
THIRD_PARTY_ENV: dict[str, str] = {}
"""Variables read by a library rather than by our options, and the container allowed to set them."""

WORKER_STOP_S = 5
"""Room in the grace period for the worker to stop after its SIGTERM (it finishes
the engine step in progress, sends terminal events and closes its sockets)."""


def _routes() -> dict[str, Callable[..., object]]:
    app = web.Application()
    handlers.add_routes(app)
    return {
        r.resource.canonical: r.handler  # type: ignore[misc]
        for r in app.router.routes()
        if r.method == "GET" and r.resource is not None
    }


def _pod(objs: Objs) -> tuple[Obj, Obj, Obj]:
    """(deployment, worker container, proxy container)."""
    d = model_server(objs)
    c = containers(d)
    assert set(c) == {"worker", "proxy"}, f"containers: {sorted(c)}"
    return d, c["worker"], c["proxy"]


def _handler(container: Obj, probe: str) -> tuple[Callable[..., object] | None, int]:
    get = container[probe]["httpGet"]
    return _routes().get(get["path"]), container_port(container, get["port"])


def _prestop_s(container: Obj) -> float:
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    assert set(hook) == {"sleep"}, f"{container['name']}: preStop {hook}: only a sleep is timed here"
    return float(hook["sleep"]["seconds"])


# --- the checks --------------------------------------------------------------------


def check_env_vars_are_options_of_their_process(objs: Objs) -> None:
    _, worker, proxy = _pod(objs)
    for c in (worker, proxy):
        names = {e["name"] for e in c.get("env", [])}
        ours = {n for n in names if n.startswith(ENV_PREFIX)}
        unknown = ours - envvars_of(process_of(c).command)
        assert not unknown, f"{c['name']}: {sorted(unknown)} are read by no option of its process"
        foreign = {n for n in names - ours if THIRD_PARTY_ENV.get(n) != c["name"]}
        assert not foreign, f"{c['name']}: {sorted(foreign)}: not ours, not in THIRD_PARTY_ENV"
        settings_of(c)  # every value parses as the process itself would parse it


def check_backend_of_image_and_env_agree(objs: Objs) -> None:
    _, worker, _ = _pod(objs)
    args = process_of(worker).args
    declared = {e["name"]: e.get("value") for e in worker.get("env", [])}.get(ENV_PREFIX + "BACKEND")
    if "--backend" in args and declared is not None:
        assert args[args.index("--backend") + 1] == declared, f"image says {args}, env says {declared}"


def check_sockets_are_shared_in_memory(objs: Objs) -> None:
    d, worker, proxy = _pod(objs)
    ws, ps = settings_of(worker), settings_of(proxy)
    assert (ws.input_addr, ws.output_addr) == (ps.input_addr, ps.output_addr)
    volumes = {v["name"]: v for v in pod_spec(d).get("volumes", [])}
    for addr in (ws.input_addr, ws.output_addr):
        assert addr is not None and addr.startswith("ipc://"), f"{addr}: the pod's link is ipc://"
        path = addr.removeprefix("ipc://")
        mounts = []
        for c in (worker, proxy):
            (m,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
            assert not m.get("readOnly"), f"{c['name']} mounts {m['mountPath']} read-only"
            mounts.append((m["name"], m["mountPath"]))
        assert mounts[0] == mounts[1], f"{addr}: worker and proxy mount {mounts}"
        assert volumes[mounts[0][0]].get("emptyDir", {}).get("medium") == "Memory", (
            "sockets: emptyDir in memory"
        )


def check_both_processes_share_one_non_root_user(objs: Objs) -> None:
    """The worker creates the sockets; connecting to a unix socket needs write
    permission on it, so the proxy must run as the same user."""
    d, worker, proxy = _pod(objs)
    pod_ctx = pod_spec(d).get("securityContext", {})
    uids = []
    for c in (worker, proxy):
        uid = c.get("securityContext", {}).get("runAsUser", pod_ctx.get("runAsUser"))
        if uid is None:
            uid = dockerfile_of(c["image"]).user
        uids.append(str(uid))
    assert uids[0] == uids[1], f"worker runs as {uids[0]}, proxy as {uids[1]}"
    assert uids[0] not in ("0", "root", "None"), f"runs as {uids[0]}"
    assert pod_ctx.get("runAsNonRoot") is True


def check_probes_and_scrape_hit_the_proxy(objs: Objs) -> None:
    d, _, proxy = _pod(objs)
    port = settings_of(proxy).port
    assert _handler(proxy, "readinessProbe") == (handlers.ready, port)
    assert _handler(proxy, "livenessProbe") == (handlers.health, port)
    notes = d["spec"]["template"]["metadata"].get("annotations", {})
    assert notes.get("prometheus.io/scrape") == "true"
    assert int(notes["prometheus.io/port"]) == port
    assert _routes().get(notes["prometheus.io/path"]) is handlers.metrics
    # Scrapers (Prometheus, the adapter's source, the endpoint picker) send no API key.
    assert notes["prometheus.io/path"] in OPEN_PATHS


def check_proxy_listens_on_the_pod_network(objs: Objs) -> None:
    _, _, proxy = _pod(objs)
    s = settings_of(proxy)
    assert s.host == "0.0.0.0", f"the proxy listens on {s.host}: the Service reaches nothing"
    assert container_port(proxy, s.port) == s.port, f"the proxy listens on {s.port}, no such containerPort"


def check_service_reaches_the_proxy(objs: Objs) -> None:
    d, _, proxy = _pod(objs)
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()
    svc = one(objs, "Service", "exl3-sidecar")
    assert svc["spec"]["selector"].items() <= labels.items()
    for p in svc["spec"]["ports"]:
        assert container_port(proxy, p["targetPort"]) == settings_of(proxy).port
    for pdb in find(objs, "PodDisruptionBudget"):
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def check_grace_period_outlasts_prestop_and_drain(objs: Objs) -> None:
    d, worker, proxy = _pod(objs)
    drain = settings_of(proxy).shutdown_drain
    abort_grace = inspect.signature(ProxyState.drain).parameters["grace_s"].default
    proxy_done = _prestop_s(proxy) + drain + abort_grace
    grace = pod_spec(d)["terminationGracePeriodSeconds"]
    assert _prestop_s(worker) >= proxy_done, (
        f"worker preStop {_prestop_s(worker)} s < proxy preStop + shutdown_drain + abort grace = "
        f"{proxy_done} s: the worker stops under requests still draining"
    )
    assert grace >= _prestop_s(worker) + WORKER_STOP_S, f"terminationGracePeriodSeconds {grace}"
    assert _prestop_s(proxy) > 0, "no preStop on the proxy: routers still send to it after SIGTERM"


def check_api_keys_come_from_a_secret(objs: Objs) -> None:
    _, _, proxy = _pod(objs)
    env = {e["name"]: e for e in proxy.get("env", [])}
    key = env.get(ENV_PREFIX + "API_KEY")
    key_file = env.get(ENV_PREFIX + "API_KEY_FILE")
    assert key is not None or key_file is not None, "no API key: /v1/* is open"
    if key is not None:
        ref = key.get("valueFrom", {}).get("secretKeyRef")
        assert ref is not None, "API keys written into the manifest"
        assert not ref.get("optional"), "an optional Secret leaves /v1/* open when it is missing"
    if key_file is not None:
        path = key_file["value"]
        (mount,) = [m for m in proxy["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
        (volume,) = [v for v in pod_spec(model_server(objs))["volumes"] if v["name"] == mount["name"]]
        assert "secret" in volume


def check_engine_matches_the_overlay(objs: Objs) -> None:
    d, worker, _ = _pod(objs)
    ws = settings_of(worker)
    image = split_image(worker["image"])[0]
    assert image.endswith(ws.backend), f"image {image} runs backend {ws.backend}"
    gpus = {
        k: v
        for c in pod_spec(d)["containers"]
        for k, v in {
            **c.get("resources", {}).get("requests", {}),
            **c.get("resources", {}).get("limits", {}),
        }.items()
        if k == "nvidia.com/gpu"
    }
    if ws.backend == "exllamav3":
        res = worker["resources"]
        assert int(res["limits"]["nvidia.com/gpu"]) >= 1
        assert (
            res["requests"].get("nvidia.com/gpu", res["limits"]["nvidia.com/gpu"])
            == res["limits"]["nvidia.com/gpu"]
        )
        model = str(ws.model_dir)
        (mount,) = [m for m in worker["volumeMounts"] if model.startswith(m["mountPath"].rstrip("/") + "/")]
        (volume,) = [v for v in pod_spec(d)["volumes"] if v["name"] == mount["name"]]
        claim = volume["persistentVolumeClaim"]["claimName"]
        assert find(objs, "PersistentVolumeClaim", claim), f"no PersistentVolumeClaim {claim} in the overlay"
    else:
        assert not gpus, f"backend {ws.backend} asks for GPUs"
        assert ws.model_dir is None or any(
            str(ws.model_dir).startswith(m["mountPath"]) for m in worker.get("volumeMounts", [])
        )


CHECKS = [
    check_env_vars_are_options_of_their_process,
    check_backend_of_image_and_env_agree,
    check_sockets_are_shared_in_memory,
    check_both_processes_share_one_non_root_user,
    check_probes_and_scrape_hit_the_proxy,
    check_proxy_listens_on_the_pod_network,
    check_service_reaches_the_proxy,
    check_grace_period_outlasts_prestop_and_drain,
    check_api_keys_come_from_a_secret,
    check_engine_matches_the_overlay,
]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_overlay(overlay: Path, check: Callable[[Objs], None]) -> None:
    check(list(rendered(overlay)))


def test_there_are_a_cpu_and_a_gpu_overlay() -> None:
    backends = {settings_of(_pod(list(rendered(o)))[1]).backend: rel(o) for o in OVERLAYS}
    assert {"cpu", "exllamav3"} <= set(backends), backends


# --- every check can fail ----------------------------------------------------------


def _env(c: Obj, name: str) -> Obj:
    (e,) = [e for e in c["env"] if e["name"] == name]
    return e


def _worker(objs: Objs) -> Obj:
    return _pod(objs)[1]


def _proxy(objs: Objs) -> Obj:
    return _pod(objs)[2]


def _spec(objs: Objs) -> Obj:
    return pod_spec(_pod(objs)[0])


def _template(objs: Objs) -> Obj:
    template: Obj = _pod(objs)[0]["spec"]["template"]
    return template


BREAKS: list[tuple[Callable[[Objs], None], str, Callable[[Objs], object]]] = [
    (check_env_vars_are_options_of_their_process, "unknown option",
     lambda o: _worker(o)["env"].append({"name": "EXL3_SIDECAR_MAX_SEQ", "value": "1"})),
    (check_env_vars_are_options_of_their_process, "bad value",
     lambda o: _env(_proxy(o), "EXL3_SIDECAR_SHUTDOWN_DRAIN").update(value="-1")),
    (check_env_vars_are_options_of_their_process, "foreign variable",
     lambda o: _proxy(o)["env"].append({"name": "TORCH_EXTENSIONS_DIR", "value": "/tmp"})),
    (check_backend_of_image_and_env_agree, "env against image",
     lambda o: _worker(o)["env"].append({"name": "EXL3_SIDECAR_BACKEND", "value": "synthetic"})
     if "--backend" in process_of(_worker(o)).args else None),
    (check_sockets_are_shared_in_memory, "other socket",
     lambda o: _env(_proxy(o), "EXL3_SIDECAR_OUTPUT_ADDR").update(value="ipc:///run/exl3-sidecar/out.sock")),
    (check_sockets_are_shared_in_memory, "socket on disk",
     lambda o: next(v for v in _spec(o)["volumes"] if v["name"] == "sockets").update(emptyDir={})),
    (check_both_processes_share_one_non_root_user, "other user",
     lambda o: _proxy(o).setdefault("securityContext", {}).update(runAsUser=10002)),
    (check_probes_and_scrape_hit_the_proxy, "liveness on /ready",
     lambda o: _proxy(o)["livenessProbe"]["httpGet"].update(path="/ready")),
    (check_probes_and_scrape_hit_the_proxy, "scrape port",
     lambda o: _template(o)["metadata"]["annotations"].update({"prometheus.io/port": "8000"})),
    (check_proxy_listens_on_the_pod_network, "port",
     lambda o: _env(_proxy(o), "EXL3_SIDECAR_PORT").update(value="8000")),
    (check_proxy_listens_on_the_pod_network, "loopback",
     lambda o: _env(_proxy(o), "EXL3_SIDECAR_HOST").update(value="127.0.0.1")),
    (check_service_reaches_the_proxy, "service selector",
     lambda o: one(o, "Service", "exl3-sidecar")["spec"]["selector"].update(app="other")),
    (check_grace_period_outlasts_prestop_and_drain, "longer drain",
     lambda o: _env(_proxy(o), "EXL3_SIDECAR_SHUTDOWN_DRAIN").update(value="60")),
    (check_grace_period_outlasts_prestop_and_drain, "short grace",
     lambda o: _spec(o).update(terminationGracePeriodSeconds=20)),
    (check_api_keys_come_from_a_secret, "literal key",
     lambda o: _env(_proxy(o), "EXL3_SIDECAR_API_KEY").update(value="k", valueFrom=None)),
    (check_api_keys_come_from_a_secret, "optional secret",
     lambda o: _env(_proxy(o), "EXL3_SIDECAR_API_KEY")["valueFrom"]["secretKeyRef"].update(optional=True)),
    (check_engine_matches_the_overlay, "gpu on the wrong side",
     lambda o: _worker(o)["resources"]["limits"].update({"nvidia.com/gpu": 0})
     if settings_of(_worker(o)).backend == "exllamav3"
     else _worker(o)["resources"]["limits"].update({"nvidia.com/gpu": 1})),
]  # fmt: skip


def test_every_check_has_a_break() -> None:
    assert {c for c, _, _ in BREAKS} == set(CHECKS)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
@pytest.mark.parametrize(
    ("check", "why", "breaking"), BREAKS, ids=[f"{c.__name__[6:]}-{w}" for c, w, _ in BREAKS]
)
def test_a_broken_pod_fails(
    overlay: Path, check: Callable[[Objs], None], why: str, breaking: Callable[[Objs], object]
) -> None:
    objs = copy.deepcopy(list(rendered(overlay)))
    check(objs)
    breaking(objs)
    for c in pod_spec(model_server(objs))["containers"]:
        c["env"] = [{k: v for k, v in e.items() if v is not None} for e in c.get("env", [])]
    if objs == list(rendered(overlay)):
        pytest.skip(f"{why}: does not apply to {overlay.name}")
    with pytest.raises((AssertionError, click.ClickException)):
        check(objs)
