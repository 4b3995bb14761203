"""The add-ons (``deploy/k8s/addons/``) fit the pods of every overlay and the
metrics the proxy really exposes: the HPA and its Prometheus adapter rule, the
PodMonitor, and the Inference Extension's InferencePool, endpoint picker (EPP)
and HTTPRoute. EPP facts are those of gateway-api-inference-extension v1.5.0,
cited in ``addons/inference-pool/epp-config.yaml``."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from proxy.ops import routes as handlers
from proxy.ops.metrics import Metrics
from tests.fakes.engine_client import WORKER, FakeEngineClient
from tests.unit.deploy.kustomize import Obj
from tests.unit.deploy.support import (
    ADDONS,
    K8S,
    OVERLAYS,
    REPO,
    container_port,
    containers,
    iter_strings,
    model_server,
    one,
    pod_spec,
    rendered,
    settings_of,
    yaml_documents,
)

SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": (),
}


@functools.cache
def exposed() -> dict[str, str]:
    """Name -> type of every family and sample name ``GET /metrics`` can carry (with a
    worker that states its KV block size, so ``cache_config_info`` is there too)."""
    worker = msgspec.structs.replace(WORKER, kv_cache_tokens=65536, kv_block_tokens=256)
    text = Metrics(FakeEngineClient(worker_ready=worker)).exposition().decode()
    names: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        names[family.name] = family.type
        for suffix in SUFFIXES.get(family.type, ()):
            names[family.name + suffix] = family.type
    return names


def gauge(name: str) -> None:
    assert exposed().get(name) == "gauge", f"{name}: not a gauge of GET /metrics ({exposed().get(name)})"


def _pods() -> list[tuple[Path, Obj]]:
    return [(o, model_server(rendered(o))) for o in OVERLAYS]


def _pod_labels(deployment: Obj) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def _proxy_port(deployment: Obj) -> int:
    port: int = settings_of(containers(deployment)["proxy"]).port
    return port


def test_every_metric_named_in_manifests_and_docs_is_exposed() -> None:
    files = [*K8S.rglob("*.yaml"), REPO / "docs" / "kubernetes.md"]
    names = {m for f in files for m in re.findall(r"\bexl3_sidecar_[a-z_]+\b", f.read_text())}
    assert names, "no metric named anywhere"
    unknown = names - set(exposed())
    assert not unknown, f"named but not exposed by proxy/ops/metrics.py: {sorted(unknown)}"


# --- HPA and the Prometheus adapter ------------------------------------------------


def _hpa() -> Obj:
    return one(rendered(ADDONS / "hpa"), "HorizontalPodAutoscaler")


def _adapter_rules() -> list[dict[str, Any]]:
    (values,) = yaml_documents(ADDONS / "hpa" / "prometheus-adapter-values.yaml")
    rules: list[dict[str, Any]] = values["rules"]["custom"]
    return rules


def test_hpa_scales_the_model_server_on_its_queue() -> None:
    hpa = _hpa()
    for _, d in _pods():
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
            d["apiVersion"],
            d["kind"],
            d["metadata"]["name"],
        )
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "exl3_sidecar_requests_waiting"
    gauge(metric["pods"]["metric"]["name"])


def test_adapter_rule_serves_the_hpa_metric_per_pod() -> None:
    name = _hpa()["spec"]["metrics"][0]["pods"]["metric"]["name"]
    (rule,) = [r for r in _adapter_rules() if r["name"].get("as") == name]
    series = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{", rule["seriesQuery"])
    assert series, rule["seriesQuery"]
    gauge(series.group(1))
    assert re.fullmatch(rule["name"]["matches"], series.group(1))
    overrides = rule["resources"]["overrides"]
    assert overrides["pod"] == {"resource": "pod"} and overrides["namespace"] == {"resource": "namespace"}
    for placeholder in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
        assert placeholder in rule["metricsQuery"]
    assert "rate(" not in rule["metricsQuery"], "a gauge is read as it is, not as a rate"


# --- PodMonitor --------------------------------------------------------------------


def test_podmonitor_scrapes_every_overlay_on_the_proxy_port() -> None:
    pm = one(rendered(ADDONS / "podmonitor"), "PodMonitor")
    app = web.Application()
    handlers.add_routes(app)
    routes = {r.resource.canonical: r.handler for r in app.router.routes() if r.resource is not None}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert routes[endpoint["path"]] is handlers.metrics
    for _, d in _pods():
        assert pm["spec"]["selector"]["matchLabels"].items() <= _pod_labels(d).items()
        assert container_port(containers(d)["proxy"], endpoint["port"]) == _proxy_port(d)


# --- Inference Extension -----------------------------------------------------------

POOL = ADDONS / "inference-pool"

EPP_FLAGS_V1_5_0 = frozenset({
    "grpc-port", "ha-enable-leader-election", "pool-group", "pool-namespace", "pool-name",
    "endpoint-selector", "endpoint-target-ports", "disable-endpoint-subset-filter",
    "model-server-metrics-scheme", "model-server-metrics-path", "model-server-metrics-port",
    "model-server-metrics-https-insecure-skip-verify", "refresh-metrics-interval",
    "refresh-prometheus-metrics-interval", "metrics-staleness-threshold", "tracing", "health-checking",
    "metrics-port", "grpc-health-port", "enable-pprof", "cert-path", "enable-cert-reload", "secure-serving",
    "metrics-endpoint-auth", "config-file", "config-text", "v", "zap-devel", "zap-encoder", "zap-log-level",
    "zap-stacktrace-level", "zap-time-encoding",
})  # fmt: skip
"""Flags of the v1.5.0 EPP: pkg/epp/server/options.go (AddFlags), pkg/common/observability/
logging/options.go (-v and controller-runtime's zap flags)."""

EPP_REJECTED_FLAGS = frozenset({
    "total-queued-requests-metric", "total-running-requests-metric", "kv-cache-usage-percentage-metric",
    "lora-info-metric", "cache-info-metric",
})  # fmt: skip
"""Deprecated in v1.4.0 and v1.5.0 and refused when set (options.go, Validate): the metric
mapping is the core-metrics-extractor's engineConfigs."""

EPP_CONFIG_FIELDS = frozenset({
    "apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "saturationDetector", "dataLayer",
    "flowControl", "parser",
})  # fmt: skip
"""EndpointPickerConfig's fields (apix/config/v1alpha1/endpointpickerconfig_types.go, v1.5.0),
decoded strictly (pkg/epp/config/loader/configloader.go)."""

EPP_PLUGIN_TYPES = frozenset({
    "queue-scorer", "running-requests-size-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer",
    "lora-affinity-scorer", "max-score-picker", "random-picker", "weighted-random-picker",
    "metrics-data-source", "core-metrics-extractor",
})  # fmt: skip
"""Plugin types of v1.5.0 (their Type constants under pkg/epp/framework/plugins/) this
check knows; add one after checking it there."""

PREFIX_CACHE_PARAMETERS = frozenset(
    {
        "autoTune",
        "blockSizeTokens",
        "maxPrefixBlocksToMatch",
        "maxPrefixTokensToMatch",
        "lruCapacityPerServer",
    }
)
"""approximateprefix/types.go, config (v1.5.0), less the deprecated blockSize."""

ENGINE_CONFIG_FIELDS = frozenset({
    "name", "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec",
    "cacheBlockSizeLabelName", "cacheNumBlocksLabelName", "cacheBlockSizeSpec", "cacheNumBlocksSpec",
})  # fmt: skip
"""engineConfigParams (extractor/metrics/factories.go, v1.5.0)."""


def _pool_objs() -> tuple[Obj, ...]:
    return rendered(POOL)


def _epp() -> Obj:
    return one(_pool_objs(), "Deployment", "exl3-sidecar-epp")


def _epp_flags() -> dict[str, str]:
    (c,) = pod_spec(_epp())["containers"]
    flags: dict[str, str] = {}
    args = list(c["args"])
    while args:
        arg = args.pop(0)
        assert arg.startswith("-"), f"EPP argument {arg!r} is not a flag"
        name, eq, value = arg.lstrip("-").partition("=")
        if not eq and args and not args[0].startswith("-"):
            value = args.pop(0)
        flags[name] = value
    return flags


def _epp_config() -> dict[str, Any]:
    """The EndpointPickerConfig the EPP reads: --config-file, through its volume, in the ConfigMap."""
    path = Path(_epp_flags()["config-file"])
    (c,) = pod_spec(_epp())["containers"]
    (mount,) = [m for m in c["volumeMounts"] if path.parent == Path(m["mountPath"])]
    (volume,) = [v for v in pod_spec(_epp())["volumes"] if v["name"] == mount["name"]]
    cm = one(_pool_objs(), "ConfigMap", volume["configMap"]["name"])
    config: dict[str, Any] = yaml.safe_load(cm["data"][path.name])
    return config


def test_pool_selects_the_pods_of_every_overlay_on_the_proxy_port() -> None:
    pool = one(_pool_objs(), "InferencePool")
    for _, d in _pods():
        assert pool["spec"]["selector"]["matchLabels"].items() <= _pod_labels(d).items()
        assert [p["number"] for p in pool["spec"]["targetPorts"]] == [_proxy_port(d)]


def test_pool_points_at_the_endpoint_picker() -> None:
    pool = one(_pool_objs(), "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    svc = one(_pool_objs(), "Service", ref["name"])
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp = _epp()
    assert svc["spec"]["selector"].items() <= _pod_labels(epp).items()
    (c,) = pod_spec(epp)["containers"]
    grpc_port = int(_epp_flags().get("grpc-port", 9002))  # DefaultGrpcPort (options.go)
    assert container_port(c, port["targetPort"]) == grpc_port
    assert _epp_flags()["pool-name"] == pool["metadata"]["name"]
    assert _epp_flags().get("pool-group", "inference.networking.k8s.io") == pool["apiVersion"].split("/")[0]


def test_route_sends_to_the_pool() -> None:
    route = one(_pool_objs(), "HTTPRoute")
    pool = one(_pool_objs(), "InferencePool")
    refs = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert refs == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]


def test_epp_flags_exist_in_its_release() -> None:
    flags = set(_epp_flags())
    assert not flags & EPP_REJECTED_FLAGS, (
        f"refused by the EPP since v1.4.0: {sorted(flags & EPP_REJECTED_FLAGS)}"
    )
    assert flags <= EPP_FLAGS_V1_5_0, f"unknown flags: {sorted(flags - EPP_FLAGS_V1_5_0)}"
    (c,) = pod_spec(_epp())["containers"]
    assert c["image"].endswith(":v1.5.0"), "the facts checked here are v1.5.0's"


def test_epp_outlives_the_pods_it_routes_to() -> None:
    grace = pod_spec(_epp())["terminationGracePeriodSeconds"]
    for _, d in _pods():
        assert grace >= pod_spec(d)["terminationGracePeriodSeconds"]


def test_epp_may_read_pods_and_pools() -> None:
    sa = pod_spec(_epp())["serviceAccountName"]
    (binding,) = [
        b
        for b in _pool_objs()
        if b["kind"] == "RoleBinding" and {"kind": "ServiceAccount", "name": sa} in b["subjects"]
    ]
    role = one(_pool_objs(), "Role", binding["roleRef"]["name"])
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               if {"get", "list", "watch"} <= set(rule["verbs"])}  # fmt: skip
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted


def test_epp_config_is_one_the_release_accepts() -> None:
    config = _epp_config()
    assert config["apiVersion"] == "inference.networking.x-k8s.io/v1alpha1"
    assert config["kind"] == "EndpointPickerConfig"
    assert set(config) <= EPP_CONFIG_FIELDS, f"unknown fields: {sorted(set(config) - EPP_CONFIG_FIELDS)}"
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    assert {p["type"] for p in plugins.values()} <= EPP_PLUGIN_TYPES
    refs = [p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]]
    for source in config.get("dataLayer", {}).get("sources", []):
        refs += [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]
    assert set(refs) <= set(plugins), f"references to no plugin: {sorted(set(refs) - set(plugins))}"
    for p in plugins.values():
        if p["type"] == "prefix-cache-scorer":
            assert set(p.get("parameters", {})) <= PREFIX_CACHE_PARAMETERS
        if p["type"] == "metrics-data-source":
            assert set(p.get("parameters", {})) <= {"scheme", "path", "insecureSkipVerify"}


def test_epp_reads_our_metrics_for_queue_running_and_kv_cache() -> None:
    config = _epp_config()
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    engines = {e["name"]: e for e in params["engineConfigs"]}
    for e in engines.values():
        assert set(e) <= ENGINE_CONFIG_FIELDS, f"unknown fields: {sorted(set(e) - ENGINE_CONFIG_FIELDS)}"
    ours = engines[params["defaultEngine"]]
    assert ours["queuedRequestsSpec"] == "exl3_sidecar_requests_waiting"
    assert ours["runningRequestsSpec"] == "exl3_sidecar_requests_running"
    assert ours["kvUsageSpec"] == "exl3_sidecar_kv_cache_usage_ratio"
    for spec in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"):
        gauge(ours[spec])
    # LoRA metrics we do not have: off, or the EPP logs errors. The cache geometry
    # is an info gauge with vLLM's labels, which the extractor reads by default.
    assert ours["loraSpec"] == ""
    gauge(ours["cacheInfoSpec"])
    labels = {
        ours.get("cacheBlockSizeLabelName", "block_size"),
        ours.get("cacheNumBlocksLabelName", "num_gpu_blocks"),
    }
    assert labels == {"block_size", "num_gpu_blocks"}
    families = text_string_to_metric_families(
        Metrics(
            FakeEngineClient(
                worker_ready=msgspec.structs.replace(WORKER, kv_cache_tokens=1024, kv_block_tokens=256)
            )
        )
        .exposition()
        .decode()
    )
    (info,) = [f for f in families if f.name == ours["cacheInfoSpec"]]
    assert set(info.samples[0].labels) == labels
    (source,) = [p for p in config["plugins"] if p["type"] == "metrics-data-source"]
    app = web.Application()
    handlers.add_routes(app)
    routes = {r.resource.canonical: r.handler for r in app.router.routes() if r.resource is not None}
    assert routes[source["parameters"]["path"]] is handlers.metrics


@pytest.mark.parametrize("path", sorted(ADDONS.rglob("*.yaml")), ids=lambda p: str(p.relative_to(ADDONS)))
def test_addon_files_name_no_vllm_metric(path: Path) -> None:
    """Our metric names are our own: an EPP left on its vLLM defaults would read nothing."""
    for doc in yaml_documents(path):
        for s in iter_strings(doc):
            for line in s.splitlines():
                if not line.lstrip().startswith("#"):
                    assert "vllm:" not in line, f"{path.name}: {line.strip()}"
