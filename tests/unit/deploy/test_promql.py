"""Every PromQL expression in deploy/ (the PrometheusRule's alerts, the Grafana
dashboard's panels and variables) is checked against what the proxy serves.

Each expression is parsed with ``promql-parser`` (the Rust parser of GreptimeDB's
PromQL, the grammar of Prometheus' own), then its tree is checked against a scrape of
the proxy's real ``Metrics`` after some traffic: every selected metric is a sample
name the proxy exposes; every label matched or grouped by is one the family carries
(or a target label Prometheus adds); ``rate``/``increase``/``irate`` take counters and
histogram series only, ``deriv``/``delta`` gauges only, a counter is never used raw;
``histogram_quantile`` reads ``_bucket`` series aggregated ``by (le)``; a bucket
matched by ``le`` names a bucket that exists. Grafana's ``$variables`` are replaced by
sample values first.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import msgspec
import promql_parser as pq
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from proxy.ops.metrics import CompletedRequest, Metrics
from tests.fakes.engine_client import WORKER, FakeEngineClient
from tests.unit.deploy.support import ADDONS, REPO, one, rendered

DASHBOARD = REPO / "deploy" / "grafana" / "exl3-sidecar.json"
TARGET_LABELS = frozenset({"namespace", "pod", "container", "job", "instance", "endpoint", "service"})
"""Labels Prometheus (a PodMonitor, the annotation scrape job) adds to every series.
``endpoint`` is also our requests_total label."""
COUNTER_FUNCS = frozenset({"rate", "irate", "increase", "resets"})
GAUGE_FUNCS = frozenset({"deriv", "delta", "idelta", "predict_linear", "changes"})
GRAFANA_VARS = {"$__rate_interval": "1m", "$namespace": "default", "$pod": ".*"}


@functools.cache
def scrape() -> dict[str, tuple[str, frozenset[str], frozenset[str]]]:
    """Sample name -> (family type, label names, ``le`` values) of the proxy's /metrics
    after one request of each kind was counted."""
    worker = msgspec.structs.replace(WORKER, kv_cache_tokens=65536, kv_block_tokens=256)
    m = Metrics(FakeEngineClient(worker_ready=worker))
    m.count_request("/v1/chat/completions", 200)
    m.count_request("/v1/completions", 503)
    m.count_error("engine_dead")
    m.observe_completed(CompletedRequest(10, 5, 3, 1, 1, 0.2, 0.5, 0.01, 0.1, (0.05,)))
    out: dict[str, tuple[str, frozenset[str], frozenset[str]]] = {}
    for family in text_string_to_metric_families(m.exposition().decode()):
        for s in family.samples:
            labels = frozenset(s.labels) | frozenset(out.get(s.name, ("", frozenset(), frozenset()))[1])
            les = out.get(s.name, ("", frozenset(), frozenset()))[2] | (
                {s.labels["le"]} if "le" in s.labels else set()
            )
            out[s.name] = (family.type, labels, frozenset(les))
    return out


def _selector_type(name: str) -> str:
    assert name in scrape(), f"{name}: not served by the proxy's /metrics"
    return scrape()[name][0]


def check(expr: str) -> None:
    """Raises AssertionError when ``expr`` does not fit the proxy's metrics (module docstring)."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    tree = pq.parse(expr)
    _check(tree, context=None, keeps_le=False)


def _check(node: Any, context: str | None, keeps_le: bool) -> None:
    if isinstance(node, pq.VectorSelector):
        _check_selector(node, context, keeps_le)
    elif isinstance(node, pq.MatrixSelector):
        assert context in COUNTER_FUNCS | GAUGE_FUNCS, f"a range vector outside a range function: {node}"
        _check_selector(node.vector_selector, context, keeps_le)
    elif isinstance(node, pq.Call):
        name = node.func.name
        if name == "histogram_quantile":
            _check(node.args[0], None, False)
            _check(node.args[1], name, False)
        else:
            for a in node.args:
                _check(a, name if name in COUNTER_FUNCS | GAUGE_FUNCS | {"absent"} else context, keeps_le)
    elif isinstance(node, pq.AggregateExpr):
        labels = list(node.modifier.labels) if node.modifier is not None else []
        by = node.modifier is not None and "By" in str(node.modifier.type)
        if context == "histogram_quantile":
            assert by and "le" in labels, f"histogram_quantile over {node}: aggregate by (le)"
        names = _names(node.expr)
        known = set().union(*(scrape()[n][1] for n in names)) if names else set()
        for label in labels:
            assert label in known | TARGET_LABELS, f"{node}: no series of {sorted(names)} has label {label}"
        _check(node.expr, context, by and "le" in labels)
    elif isinstance(node, pq.BinaryExpr):
        _check(node.lhs, context, keeps_le)
        _check(node.rhs, context, keeps_le)
    elif isinstance(node, pq.ParenExpr | pq.UnaryExpr):
        _check(node.expr, context, keeps_le)
    elif isinstance(node, pq.SubqueryExpr):
        _check(node.expr, None, keeps_le)
    else:
        assert isinstance(node, pq.NumberLiteral | pq.StringLiteral), f"unchecked node {type(node).__name__}"


def _names(node: Any) -> set[str]:
    found: set[str] = set()

    def visit(n: Any) -> None:
        if isinstance(n, pq.VectorSelector) and n.name:
            found.add(n.name)

    pq.walk(node, visit, None)
    return found


def _check_selector(vs: Any, context: str | None, keeps_le: bool) -> None:
    name = vs.name
    kind = _selector_type(name)
    _, labels, les = scrape()[name]
    for m in vs.matchers.matchers:
        assert m.name in labels | TARGET_LABELS, f"{name} has no label {m.name}"
        if m.name == "le" and str(m.op).endswith("Equal") and "Not" not in str(m.op):
            assert m.value in les, f"{name}: no bucket le={m.value!r} (buckets: {sorted(les, key=float)})"
    if context in COUNTER_FUNCS:
        assert kind in ("counter", "histogram"), f"{context}() over {name}, a {kind}"
    elif context in GAUGE_FUNCS:
        assert kind == "gauge", f"{context}() over {name}, a {kind}: use rate() for counters"
    elif context == "histogram_quantile":
        assert name.endswith("_bucket") and kind == "histogram", f"histogram_quantile over {name}"
    elif context != "absent":
        assert kind == "gauge" or kind == "info", f"{name}: a {kind} used raw (rate() it)"


# --- the expressions ------------------------------------------------------------------


def _rules() -> list[dict[str, Any]]:
    rule = one(rendered(ADDONS / "alerts"), "PrometheusRule")
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def _panel_exprs() -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in _dashboard()["panels"] for t in p["targets"]]


def _variable_exprs() -> list[tuple[str, str]]:
    out = []
    for v in _dashboard()["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"]["query"])
            assert m, f"variable {v['name']}: {v['query']['query']}"
            out.append((f"${v['name']}", m.group(1)))
    return out


EXPRESSIONS = [
    *[(f"alert {r['alert']}", r["expr"]) for r in _rules()],
    *[(f"panel {t}", e) for t, e in _panel_exprs()],
    *[(f"variable {t}", e) for t, e in _variable_exprs()],
]


@pytest.mark.parametrize(("where", "expr"), EXPRESSIONS, ids=[w for w, _ in EXPRESSIONS])
def test_expression_fits_the_metrics_the_proxy_serves(where: str, expr: str) -> None:
    check(expr)


@pytest.mark.parametrize(
    "bad",
    [
        "exl3_sidecar_request_running",  # misspelt
        "rate(exl3_sidecar_requests_waiting[5m])",  # rate of a gauge
        "deriv(exl3_sidecar_generation_tokens_total[5m])",  # deriv of a counter
        "exl3_sidecar_generation_tokens_total",  # a counter used raw
        # no by (le)
        "histogram_quantile(0.9, sum(rate(exl3_sidecar_time_to_first_token_seconds_bucket[5m])))",
        "histogram_quantile(0.9, sum by (le) (rate(exl3_sidecar_time_to_first_token_seconds_count[5m])))",
        'sum(rate(exl3_sidecar_time_to_first_token_seconds_bucket{le="3"}[5m]))',  # no such bucket
        'sum(rate(exl3_sidecar_request_errors_total{status="500"}[5m]))',  # no such label
        "sum by (model) (rate(exl3_sidecar_requests_total[5m]))",  # grouped by a label it lacks
        "sum(rate(exl3_sidecar_requests_total[5m]",  # does not parse
    ],
)
def test_a_wrong_expression_fails(bad: str) -> None:
    with pytest.raises((AssertionError, ValueError, SyntaxError, Exception)) as e:
        check(bad)
    assert not isinstance(e.value, KeyError | TypeError | AttributeError), (
        f"{bad}: the checker itself broke: {e.value!r}"
    )


def test_the_dashboard_has_the_panels_an_operator_looks_at_first() -> None:
    everything = set().union(*(_names(pq.parse(_sub(e))) for _, e in _panel_exprs()))
    wanted = {
        "requests running": "exl3_sidecar_requests_running",
        "requests waiting": "exl3_sidecar_requests_waiting",
        "queue time": "exl3_sidecar_queue_time_seconds_bucket",
        "TTFT": "exl3_sidecar_time_to_first_token_seconds_bucket",
        "ITL": "exl3_sidecar_inter_token_latency_seconds_bucket",
        "tokens/s": "exl3_sidecar_generation_tokens_total",
        "prefix-cache hits": "exl3_sidecar_prompt_tokens_cached_total",
        "draft acceptance": "exl3_sidecar_draft_tokens_accepted_total",
        "errors by code": "exl3_sidecar_request_errors_total",
        "worker up": "exl3_sidecar_worker_up",
    }
    missing = {k: v for k, v in wanted.items() if v not in everything}
    assert not missing, f"no panel shows {missing}"
    quantiles = {e for t, e in _panel_exprs() if "time_to_first_token" in e or "inter_token" in e}
    assert len(quantiles) >= 6, "TTFT and ITL: three percentiles each"
    assert any("by (code)" in e for _, e in _panel_exprs())


def test_the_alerts_cover_worker_down_queue_errors_and_ttft() -> None:
    names = {r["alert"]: r for r in _rules()}
    by_metric = {k: _names(pq.parse(r["expr"])) for k, r in names.items()}
    assert any("exl3_sidecar_worker_up" in m for m in by_metric.values())
    assert any("exl3_sidecar_requests_waiting" in m for m in by_metric.values())
    assert any("exl3_sidecar_requests_total" in m for m in by_metric.values())
    assert any("exl3_sidecar_time_to_first_token_seconds_bucket" in m for m in by_metric.values())
    for r in names.values():
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]


def test_alert_rules_are_valid_rule_yaml() -> None:
    """Every rule has an alert name, an expression and a Prometheus duration."""
    for r in _rules():
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", r["alert"])
        if "for" in r:
            assert re.fullmatch(r"\d+[smhd]", r["for"])
    yaml.safe_dump(_rules())


def _sub(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return expr
