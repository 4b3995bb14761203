"""Each overlay's pod agrees with the code it runs: every environment variable is
an option of the process that reads it and parses with it, both processes meet at
the same sockets on a shared in-memory volume, probes and the scrape hit the
proxy's real handlers on its real port, the grace period outlasts preStop + drain,
the API keys come from a Secret, and the GPU and CPU overlays are what they say.

Each check is a function over a rendered overlay; ``test_a_broken_pod_fails``
breaks a copy of an overlay once per check, so every check is seen failing.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import re
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import click
import pytest
from aiohttp import web

from engine_worker import probe
from protocol.settings import ENV_PREFIX
from proxy.ops import routes as handlers
from proxy.server.probes import PROBE_PATHS
from proxy.server.state import ProxyState
from tests.unit.deploy.kustomize import Obj, split_image
from tests.unit.deploy.support import (
    ADDONS,
    OVERLAYS,
    container_port,
    containers,
    dockerfile_of,
    env_of,
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
THIRD_PARTY_ENV: dict[str, str] = {
    # The downward API's pod IP: the default KV-event topic's pod (engine_worker.kv_events.default_topic),
    # and $(POD_IP) in an explicit EXL3_SIDECAR_KV_EVENTS_TOPIC.
    "POD_IP": "worker",
}
"""Variables not read by our options (by a library, or the kv_events topic's default), and the
container allowed to set them."""

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


PROBE = ["python", "-m", "engine_worker.probe"]
"""How the worker container runs ``engine_worker/probe.py``."""


def _probe_args(command: list[str]) -> argparse.Namespace:
    """An exec probe's command parsed by ``engine_worker.probe``'s own parser."""
    assert command[:3] == PROBE, f"{command}: not {' '.join(PROBE)}"
    parsed: dict[str, argparse.Namespace] = {}

    def keep(self: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
        return parsed.setdefault("args", argparse.ArgumentParser.parse_known_args(self, argv)[0])

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", keep),
        mock.patch.object(probe, "_live", lambda a: 0),
        mock.patch.object(probe, "_wait_port_closed", lambda a: 0),
    ):
        assert probe.main(command[3:]) == 0
    return parsed["args"]


def _prestop_s(container: Obj) -> float:
    """Seconds the container's preStop hook may take: a sleep, or the probe's
    wait-port-closed (its --timeout)."""
    hook = container.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0.0
    if "exec" in hook:
        args = _probe_args(hook["exec"]["command"])
        assert args.probe == "wait-port-closed", f"{container['name']}: preStop {hook}"
        return float(args.timeout)
    assert set(hook) == {"sleep"}, f"{container['name']}: preStop {hook}: only a sleep or the probe is timed"
    return float(hook["sleep"]["seconds"])


def _route_timeout_s() -> float:
    """The HTTPRoute's request timeout (addons/inference-pool), in seconds."""
    route = one(rendered(ADDONS / "inference-pool"), "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    value = rule["timeouts"]["request"]
    m = re.fullmatch(r"(\d+)(ms|s|m|h)", value)
    assert m, f"route timeout {value}: not a Gateway API duration this check reads"
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]


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
    assert notes["prometheus.io/path"] in PROBE_PATHS


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
    route = _route_timeout_s()
    assert route <= drain, (
        f"HTTPRoute timeout {route} s > shutdown_drain {drain} s: a rollout cuts requests the route allows"
    )
    hook = worker.get("lifecycle", {}).get("preStop", {})
    if "exec" in hook:
        assert _probe_args(hook["exec"]["command"]).port == settings_of(proxy).port, "waits on another port"
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


def check_worker_probes_restart_a_hung_worker(objs: Objs) -> None:
    """The worker container's own startup and liveness probes read the heartbeat
    file the worker writes, judge it as the proxy does (age = heartbeat_timeout),
    give the model load its budget and kill a hung worker without a drain."""
    d, worker, proxy = _pod(objs)
    ws, ps = settings_of(worker), settings_of(proxy)
    assert ws.heartbeat_file is not None, "the worker writes no heartbeat file: no probe can judge it"
    (mount,) = [m for m in worker["volumeMounts"] if str(ws.heartbeat_file).startswith(m["mountPath"] + "/")]
    assert not mount.get("readOnly"), "the heartbeat file is on a read-only mount"
    startup, live = worker.get("startupProbe"), worker.get("livenessProbe")
    assert startup and live, "the worker container has no startup or liveness probe"
    for probe_spec in (startup, live):
        args = _probe_args(probe_spec["exec"]["command"])
        assert args.probe == "live" and args.file is None  # the file from the container's environment
        assert args.max_age == ps.heartbeat_timeout, f"--max-age {args.max_age} != heartbeat_timeout"
        assert args.max_age >= 5 * ws.heartbeat_interval, "a beat or two late is not hung"
        assert probe_spec.get("timeoutSeconds", 1) >= 2, (
            "an exec of Python needs more than 1 s on a busy node"
        )
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    need = STARTUP_BUDGET_S[ws.backend]
    assert budget >= need, f"startup probe allows {budget} s for a {ws.backend} load that may take {need} s"
    assert d["spec"]["progressDeadlineSeconds"] > budget, "progressDeadlineSeconds ends before the load can"
    assert live["failureThreshold"] >= 2, "one failed exec (a busy node) must not restart a model"
    assert live.get("terminationGracePeriodSeconds", 1e9) <= 10, (
        "a hung worker waits out the pod's grace period"
    )


def check_rollouts_and_drains_keep_serving(objs: Objs) -> None:
    d, _, _ = _pod(objs)
    replicas = d["spec"].get("replicas", 1)
    assert replicas >= 2, f"{replicas} replica(s): every rollout and node drain is an outage"
    rolling = d["spec"]["strategy"]["rollingUpdate"]
    assert int(rolling["maxUnavailable"]) < replicas, "a rollout may take every replica away"
    assert int(rolling["maxUnavailable"]) + int(rolling["maxSurge"]) >= 1, "a rollout that cannot progress"
    (pdb,) = find(objs, "PodDisruptionBudget")
    if "minAvailable" in pdb["spec"]:
        assert 1 <= int(pdb["spec"]["minAvailable"]) < replicas, f"PDB {pdb['spec']}"
    else:
        assert 1 <= int(pdb["spec"]["maxUnavailable"]) < replicas, f"PDB {pdb['spec']}"


CACHE_ENV = ("TRITON_CACHE_DIR", "TRITON_HOME", "XDG_CACHE_HOME", "HF_HOME", "TMPDIR")
"""Variables naming where a library writes at run time."""


def check_read_only_roots_with_writable_caches(objs: Objs) -> None:
    d, worker, proxy = _pod(objs)
    volumes = {v["name"]: v for v in pod_spec(d)["volumes"]}
    for c in (worker, proxy):
        assert c.get("securityContext", {}).get("readOnlyRootFilesystem") is True, (
            f"{c['name']}: writable root"
        )
        env = env_of(c)
        places = [env[k] for k in CACHE_ENV if k in env]
        if c is worker:
            places.append("/tmp")  # Python's tempfile, Triton's C launcher build
        for place in places:
            mounts = [
                m
                for m in c.get("volumeMounts", [])
                if (place + "/").startswith(m["mountPath"].rstrip("/") + "/")
            ]
            assert mounts, f"{c['name']}: {place} is on the read-only root"
            m = max(mounts, key=lambda m: len(m["mountPath"]))
            assert "emptyDir" in volumes[m["name"]] and not m.get("readOnly"), (
                f"{c['name']}: {place} not writable"
            )


STARTUP_BUDGET_S = {"cpu": 60, "exllamav3": 600, "synthetic": 10}
"""Least time a model load must be allowed, seconds: the embedded model loads in ~1 s
(20 s converting on a cold cache); an EXL3 model of tens of GB from a network volume
plus warm-up in minutes."""


def check_pod_is_a_good_neighbour(objs: Objs) -> None:
    d, worker, proxy = _pod(objs)
    spec = pod_spec(d)
    assert spec.get("automountServiceAccountToken") is False, "neither process talks to the Kubernetes API"
    labels = d["spec"]["template"]["metadata"]["labels"]
    spread = {c["topologyKey"]: c for c in spec.get("topologySpreadConstraints", [])}
    assert "kubernetes.io/hostname" in spread, "replicas may all land on one node"
    assert spread["kubernetes.io/hostname"]["labelSelector"]["matchLabels"].items() <= labels.items()
    for c in (worker, proxy):
        assert "ephemeral-storage" in c.get("resources", {}).get("requests", {}), (
            f"{c['name']}: no ephemeral-storage"
        )
    if settings_of(worker).backend == "exllamav3":
        res = worker["resources"]
        assert res["requests"]["memory"] == res["limits"]["memory"], "GPU worker: memory request != limit"
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        (term,) = terms["nodeSelectorTerms"]
        exprs = {e["key"]: e for e in term["matchExpressions"]}
        driver = exprs["nvidia.com/cuda.driver-version.major"]
        assert driver["operator"] == "Gt" and int(driver["values"][0]) + 1 >= 580, (
            "CUDA 13 needs driver R580+"
        )
        arch = re.search(r'^ARG TORCH_CUDA_ARCH_LIST="([^"]+)"', dockerfile_of(worker["image"]).text, re.M)
        assert arch
        lowest = min(int(a.split(".")[0]) for a in arch.group(1).split(";"))
        compute = exprs["nvidia.com/gpu.compute.major"]
        assert compute["operator"] == "Gt" and int(compute["values"][0]) + 1 == lowest, (
            f"nodes of compute capability {int(compute['values'][0]) + 1}+, image built from {lowest}"
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
    check_worker_probes_restart_a_hung_worker,
    check_rollouts_and_drains_keep_serving,
    check_read_only_roots_with_writable_caches,
    check_pod_is_a_good_neighbour,
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


def _unmount(c: Obj, path: str) -> None:
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != path]


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
    (check_grace_period_outlasts_prestop_and_drain, "route outlasts the drain",
     lambda o: _env(_proxy(o), "EXL3_SIDECAR_SHUTDOWN_DRAIN").update(value="200")),
    (check_worker_probes_restart_a_hung_worker, "no liveness",
     lambda o: _worker(o).pop("livenessProbe")),
    (check_worker_probes_restart_a_hung_worker, "max-age off the proxy's timeout",
     lambda o: _worker(o)["livenessProbe"]["exec"].update(
         command=[*PROBE, "live", "--max-age", "90"])),
    (check_worker_probes_restart_a_hung_worker, "short startup",
     lambda o: _worker(o)["startupProbe"].update(failureThreshold=2)),
    (check_worker_probes_restart_a_hung_worker, "no heartbeat file",
     lambda o: _worker(o)["env"].remove(_env(_worker(o), "EXL3_SIDECAR_HEARTBEAT_FILE"))),
    (check_worker_probes_restart_a_hung_worker, "hung worker drains",
     lambda o: _worker(o)["livenessProbe"].pop("terminationGracePeriodSeconds")),
    (check_rollouts_and_drains_keep_serving, "one replica",
     lambda o: _pod(o)[0]["spec"].update(replicas=1)),
    (check_rollouts_and_drains_keep_serving, "pdb takes all",
     lambda o: one(o, "PodDisruptionBudget")["spec"].update(minAvailable=0)),
    (check_read_only_roots_with_writable_caches, "writable root",
     lambda o: _worker(o)["securityContext"].update(readOnlyRootFilesystem=False)),
    (check_read_only_roots_with_writable_caches, "no tmp",
     lambda o: _unmount(_worker(o), "/tmp")),
    (check_read_only_roots_with_writable_caches, "triton cache on the root",
     lambda o: _unmount(_worker(o), "/cache")),
    (check_pod_is_a_good_neighbour, "token mounted",
     lambda o: _spec(o).pop("automountServiceAccountToken")),
    (check_pod_is_a_good_neighbour, "no spread",
     lambda o: _spec(o).pop("topologySpreadConstraints")),
    (check_pod_is_a_good_neighbour, "no ephemeral storage",
     lambda o: _proxy(o)["resources"]["requests"].pop("ephemeral-storage")),
    (check_pod_is_a_good_neighbour, "gpu memory overcommitted",
     lambda o: _worker(o)["resources"]["requests"].update(memory="16Gi")
     if settings_of(_worker(o)).backend == "exllamav3" else None),
    (check_pod_is_a_good_neighbour, "old driver",
     lambda o: _spec(o)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
         "nodeSelectorTerms"][0]["matchExpressions"][0].update(values=["534"])
     if settings_of(_worker(o)).backend == "exllamav3" else None),
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
