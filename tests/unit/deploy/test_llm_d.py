"""``addons/llm-d-precise-prefix`` fits the pods of ``overlays/cpu-kv-events``: llm-d's
precise prefix-cache scorer dials the port the workers publish their KV-cache events on,
reads the topic they send, computes blocks of the size they publish, and its picker's
flags, configuration and plugin parameters are names its release knows.

Facts of llm-d-inference-scheduler v0.5.0 (its go.mod: llm-d-kv-cache v0.5.0,
gateway-api-inference-extension v1.3.0), cited in the add-on's files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from engine_worker.cpu.llama import BLOCK_TOKENS
from engine_worker.options.exllamav3 import PAGE_SIZE
from tests.unit.deploy.kustomize import Obj
from tests.unit.deploy.support import (
    ADDONS,
    K8S,
    container_port,
    containers,
    env_of,
    model_server,
    one,
    pod_spec,
    rendered,
    settings_of,
)
from tests.unit.deploy.test_addons import gauge

ADDON = ADDONS / "llm-d-precise-prefix"
KV_OVERLAYS = (K8S / "overlays" / "cpu-kv-events",)
"""The overlays whose pods publish KV-cache events for this add-on."""

EPP_FLAGS_V1_3_0 = frozenset({
    "grpc-port", "ha-enable-leader-election", "pool-group", "pool-namespace", "pool-name",
    "endpoint-selector", "endpoint-target-ports", "disable-endpoint-subset-filter",
    "model-server-metrics-scheme", "model-server-metrics-path", "model-server-metrics-port",
    "model-server-metrics-https-insecure-skip-verify", "refresh-metrics-interval",
    "refresh-prometheus-metrics-interval", "metrics-staleness-threshold", "total-queued-requests-metric",
    "total-running-requests-metric", "kv-cache-usage-percentage-metric", "lora-info-metric",
    "cache-info-metric", "v", "tracing", "health-checking", "metrics-port", "grpc-health-port",
    "enable-pprof", "cert-path", "enable-cert-reload", "secure-serving", "metrics-endpoint-auth",
    "config-file", "config-text", "zap-devel", "zap-encoder", "zap-log-level", "zap-stacktrace-level",
    "zap-time-encoding",
})  # fmt: skip
"""pkg/epp/server/options.go (AddFlags) of gateway-api-inference-extension v1.3.0, plus
controller-runtime's zap flags it adds."""

EPP_CONFIG_FIELDS = frozenset(
    {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "saturationDetector", "data"}
)
"""apix/config/v1alpha1/endpointpickerconfig_types.go at v1.3.0."""

PLUGIN_TYPES = frozenset({
    # gateway-api-inference-extension v1.3.0 (their Type constants under pkg/epp/)
    "single-profile-handler", "queue-scorer", "kv-cache-utilization-scorer", "running-requests-size-scorer",
    "lora-affinity-scorer", "prefix-cache-scorer", "max-score-picker", "random-picker",
    "weighted-random-picker",
    # llm-d-inference-scheduler v0.5.0 (pkg/plugins/register.go), the ones used here
    "precise-prefix-cache-scorer",
})  # fmt: skip

SCORER_PARAMETERS = {
    "": {"tokenProcessorConfig", "indexerConfig", "kvEventsConfig"},
    "tokenProcessorConfig": {"blockSize", "hashSeed"},
    "indexerConfig": {
        "prefixStoreConfig", "kvBlockIndexConfig", "tokenizersPoolConfig", "kvCacheBackendConfigs",
    },
    "indexerConfig.tokenizersPoolConfig": {
        "modelName", "workersCount", "minPrefixOverlapRatio", "local", "uds", "hf",
    },
    "indexerConfig.tokenizersPoolConfig.hf": {"enabled", "huggingFaceToken", "tokenizersCacheDir"},
    "kvEventsConfig": {"zmqEndpoint", "topicFilter", "concurrency", "discoverPods", "podDiscoveryConfig"},
    "kvEventsConfig.podDiscoveryConfig": {"podLabelSelector", "podNamespace", "socketPort"},
}  # fmt: skip
"""The JSON names of the scorer's parameters, by path: PrecisePrefixCachePluginConfig
(llm-d-inference-scheduler v0.5.0, precise_prefix_cache.go) and, from llm-d-kv-cache
v0.5.0, kvblock.TokenProcessorConfig, kvcache.Config, tokenization.Config and
HFTokenizerConfig, kvevents.Config and PodDiscoveryConfig. Decoded without strictness, so
a misspelt one would be ignored: every key is checked here."""


def _objs() -> tuple[Obj, ...]:
    return rendered(ADDON)


def _epp() -> Obj:
    (c,) = pod_spec(one(_objs(), "Deployment", "exl3-sidecar-epp"))["containers"]
    container: Obj = c
    return container


def _flags() -> dict[str, str]:
    out: dict[str, str] = {}
    for arg in _epp()["args"]:
        assert arg.startswith("--") and "=" in arg, f"EPP argument {arg!r}: --name=value expected"
        name, _, value = arg[2:].partition("=")
        out[name] = value
    return out


def _config() -> dict[str, Any]:
    path = Path(_flags()["config-file"])
    spec = pod_spec(one(_objs(), "Deployment", "exl3-sidecar-epp"))
    (mount,) = [m for m in _epp()["volumeMounts"] if Path(m["mountPath"]) == path.parent]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    cm = one(_objs(), "ConfigMap", volume["configMap"]["name"])
    config: dict[str, Any] = yaml.safe_load(cm["data"][path.name])
    return config


def _scorer() -> dict[str, Any]:
    (p,) = [p for p in _config()["plugins"] if p["type"] == "precise-prefix-cache-scorer"]
    params: dict[str, Any] = p["parameters"]
    return params


def test_the_picker_is_llm_ds_and_its_flags_exist_there() -> None:
    assert _epp()["image"] == "ghcr.io/llm-d/llm-d-inference-scheduler:v0.5.0", "the facts here are v0.5.0's"
    flags = _flags()
    assert set(flags) <= EPP_FLAGS_V1_3_0, sorted(set(flags) - EPP_FLAGS_V1_3_0)
    # Metrics by flag in v1.3.0: ours, not vLLM's defaults; LoRA off.
    for flag in (
        "total-queued-requests-metric",
        "total-running-requests-metric",
        "kv-cache-usage-percentage-metric",
    ):
        gauge(flags[flag])
    gauge(flags["cache-info-metric"])
    assert flags["lora-info-metric"] == ""
    assert flags["pool-name"] == one(_objs(), "InferencePool")["metadata"]["name"]


def test_the_configuration_names_only_what_the_release_knows() -> None:
    config = _config()
    assert set(config) <= EPP_CONFIG_FIELDS
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    assert {p["type"] for p in plugins.values()} <= PLUGIN_TYPES
    refs = {p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]}
    assert refs <= set(plugins)
    assert "precise-prefix-cache-scorer" in refs

    def walk(node: dict[str, Any], path: str) -> None:
        allowed = SCORER_PARAMETERS.get(path)
        if allowed is None:
            return
        assert set(node) <= allowed, f"{path or 'parameters'}: unknown {sorted(set(node) - allowed)}"
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{path}.{key}" if path else key)

    walk(_scorer(), "")


def test_the_scorer_reads_what_the_pods_publish() -> None:
    params = _scorer()
    events = params["kvEventsConfig"]
    assert events["discoverPods"] is True and "zmqEndpoint" not in events  # it dials the pods
    model = params["indexerConfig"]["tokenizersPoolConfig"]["modelName"]
    for overlay in KV_OVERLAYS:
        deployment = model_server(rendered(overlay))
        worker, proxy = containers(deployment)["worker"], containers(deployment)["proxy"]
        s = settings_of(worker)
        env = env_of(worker)
        # The socket: bound on every address, on the port the scorer dials, declared.
        assert s.kv_events_endpoint == f"tcp://*:{events['podDiscoveryConfig']['socketPort']}"
        assert container_port(worker, "kv-events") == events["podDiscoveryConfig"]["socketPort"]
        # The topic: kv@<pod IP>@<model>; the pod IP from the downward API, defined before
        # the topic names it (the kubelet expands $(VAR) only from earlier variables).
        (pod_ip,) = [e for e in worker["env"] if e["name"] == "POD_IP"]
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        names = [e["name"] for e in worker["env"]]
        assert names.index("POD_IP") < names.index("EXL3_SIDECAR_KV_EVENTS_TOPIC")
        assert env["EXL3_SIDECAR_KV_EVENTS_TOPIC"] == f"kv@$(POD_IP)@{model}"
        assert env["EXL3_SIDECAR_KV_EVENTS_TOPIC"].startswith(events["topicFilter"])
        # Requests carry the model the proxy serves: the same name as the topic's.
        assert settings_of(proxy).served_model_name == model
        # Block size: the CPU engine publishes its prefix-cache blocks (ModelInfo.kv_block_tokens =
        # min(BLOCK_TOKENS, chunk_size), engine_worker/cpu/backend.py), ExLlamaV3 its pages; llm-d
        # v0.5.0 maps them 1:1.
        engine_block = min(BLOCK_TOKENS, s.chunk_size) if s.backend == "cpu" else PAGE_SIZE
        assert params["tokenProcessorConfig"]["blockSize"] == engine_block


def test_network_policies_let_the_scorer_reach_the_event_sockets() -> None:
    port = _scorer()["kvEventsConfig"]["podDiscoveryConfig"]["socketPort"]
    epp_labels = one(_objs(), "Deployment", "exl3-sidecar-epp")["spec"]["template"]["metadata"]["labels"]
    epp_policy = one(_objs(), "NetworkPolicy", "exl3-sidecar-epp")
    for overlay in KV_OVERLAYS:
        pod_labels = model_server(rendered(overlay))["spec"]["template"]["metadata"]["labels"]
        out = [
            r
            for r in epp_policy["spec"]["egress"]
            if any(t["podSelector"]["matchLabels"].items() <= pod_labels.items() for t in r.get("to", []))
        ]
        assert any({"protocol": "TCP", "port": port} in r["ports"] for r in out)
        policy = one(rendered(overlay), "NetworkPolicy", "exl3-sidecar")
        rules = [r for r in policy["spec"]["ingress"] if {"protocol": "TCP", "port": port} in r["ports"]]
        (rule,) = rules
        # From the picker only; the proxy's port stays open as in the base.
        assert [f["podSelector"]["matchLabels"] for f in rule["from"]] == [
            {k: v for k, v in epp_labels.items() if k == "app.kubernetes.io/name"}
        ]
        assert any(
            {"protocol": "TCP", "port": 5000} in r["ports"] and "from" not in r
            for r in policy["spec"]["ingress"]
        )


def test_the_tokenizer_cache_is_on_a_writable_volume() -> None:
    cache = Path(_scorer()["indexerConfig"]["tokenizersPoolConfig"]["hf"]["tokenizersCacheDir"])
    assert _epp()["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {Path(m["mountPath"]): m["name"] for m in _epp()["volumeMounts"]}
    (name,) = [n for p, n in mounts.items() if p == cache or p in cache.parents]
    volumes = {v["name"]: v for v in pod_spec(one(_objs(), "Deployment", "exl3-sidecar-epp"))["volumes"]}
    assert "emptyDir" in volumes[name]
