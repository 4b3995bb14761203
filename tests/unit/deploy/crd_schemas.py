"""JSON Schemas for the custom resources in ``deploy/k8s/`` that kubernetes-validate
does not ship (it knows the built-in kinds only).

Each schema is written here from the published API of its project (sources
below: field names, types, enums, bounds and patterns), not copied from it. An
object must use only the fields listed (``additionalProperties: false``): a
field the API has but these schemas lack is added here after checking that
source, so a typo never passes. CEL rules of the CRDs are expressed as JSON
Schema where that is exact (noted per schema).
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_GROUP = r"^$|" + _DNS_SUBDOMAIN
_KIND = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_PORT_NUMBER: Schema = {"type": "integer", "minimum": 1, "maximum": 65535}


def _object(properties: dict[str, Schema], required: tuple[str, ...] = ()) -> Schema:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


_METADATA: Schema = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": _DNS_SUBDOMAIN},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string", "pattern": _LABEL_VALUE}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "required": ["name"],
    "additionalProperties": False,
}


def _resource(api_version: str, kind: str, spec: Schema) -> Schema:
    """A namespaced object as written in a manifest: no status."""
    return _object(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        ("apiVersion", "kind", "metadata", "spec"),
    )


# --- InferencePool, inference.networking.k8s.io/v1 -------------------------------
# kubernetes-sigs/gateway-api-inference-extension, api/v1/inferencepool_types.go and
# api/v1/shared_types.go, and the CRD generated from them,
# config/crd/bases/inference.networking.k8s.io_inferencepools.yaml, at v1.5.0
# (df9f8909) and v1.6.0 (992e5c29). Differences: appProtocol exists since v1.5.0;
# endpointPickerRef is required up to v1.5.0 and optional in v1.6.0. Required here,
# since the gateways that implement the pool need it (the v1.6.0 type's comment on
# the EndpointPickerRefMissing reason). CEL rules: targetPorts' "port number must be
# unique" is uniqueItems (an item is a number and nothing else); endpointPickerRef's
# "port is required when kind is Service or unspecified" is the anyOf below.
_PORT: Schema = _object({"number": _PORT_NUMBER}, ("number",))

INFERENCE_POOL_V1 = _resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    _object(
        {
            "selector": _object(
                {
                    "matchLabels": {
                        "type": "object",
                        "minProperties": 1,
                        "maxProperties": 64,
                        "additionalProperties": {"type": "string", "maxLength": 63, "pattern": _LABEL_VALUE},
                    }
                },
                ("matchLabels",),
            ),
            "targetPorts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "uniqueItems": True,
                "items": _PORT,
            },
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": {
                **_object(
                    {
                        "group": {"type": "string", "maxLength": 253, "pattern": _GROUP},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": _KIND},
                        "name": {"type": "string", "minLength": 1, "maxLength": 253},
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    },
                    ("name",),
                ),
                "anyOf": [
                    {"required": ["port"]},
                    {"required": ["kind"], "properties": {"kind": {"not": {"const": "Service"}}}},
                ],
            },
        },
        ("selector", "targetPorts", "endpointPickerRef"),
    ),
)


# --- PodMonitor, monitoring.coreos.com/v1 ------------------------------------------
# prometheus-operator/prometheus-operator, pkg/apis/monitoring/v1/podmonitor_types.go
# (PodMonitorSpec, PodMetricsEndpoint) and types.go (Duration's pattern,
# NamespaceSelector). A subset of the fields: selector (required: no omitempty),
# namespaceSelector, jobLabel, podTargetLabels, sampleLimit, podMetricsEndpoints with
# port (a container port's name), path, scheme, interval, scrapeTimeout, honorLabels.
_PROM_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_LABEL_SELECTOR: Schema = _object(
    {
        "matchLabels": {
            "type": "object",
            "additionalProperties": {"type": "string", "pattern": _LABEL_VALUE},
        },
        "matchExpressions": {
            "type": "array",
            "items": _object(
                {
                    "key": {"type": "string"},
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": {"type": "string"}},
                },
                ("key", "operator"),
            ),
        },
    }
)

POD_MONITOR_V1 = _resource(
    "monitoring.coreos.com/v1",
    "PodMonitor",
    _object(
        {
            "selector": _LABEL_SELECTOR,
            "namespaceSelector": _object(
                {"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}
            ),
            "jobLabel": {"type": "string"},
            "podTargetLabels": {"type": "array", "items": {"type": "string"}},
            "sampleLimit": {"type": "integer", "minimum": 0},
            "podMetricsEndpoints": {
                "type": "array",
                "items": _object(
                    {
                        "port": {"type": "string", "minLength": 1},
                        "path": {"type": "string"},
                        "scheme": {"enum": ["http", "https"]},
                        "interval": {"type": "string", "pattern": _PROM_DURATION},
                        "scrapeTimeout": {"type": "string", "pattern": _PROM_DURATION},
                        "honorLabels": {"type": "boolean"},
                    }
                ),
            },
        },
        ("selector",),
    ),
)


# --- PrometheusRule, monitoring.coreos.com/v1 ---------------------------------------
# prometheus-operator/prometheus-operator, pkg/apis/monitoring/v1/prometheusrule_types.go
# (PrometheusRuleSpec, RuleGroup, Rule: one of alert or record, expr required, for and
# keep_firing_for a Duration). A subset: groups (name, interval, rules).
PROMETHEUS_RULE_V1 = _resource(
    "monitoring.coreos.com/v1",
    "PrometheusRule",
    _object(
        {
            "groups": {
                "type": "array",
                "items": _object(
                    {
                        "name": {"type": "string", "minLength": 1},
                        "interval": {"type": "string", "pattern": _PROM_DURATION},
                        "rules": {
                            "type": "array",
                            "items": {
                                **_object(
                                    {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        "expr": {"type": ["string", "integer"], "minLength": 1},
                                        "for": {"type": "string", "pattern": _PROM_DURATION},
                                        "keep_firing_for": {"type": "string", "pattern": _PROM_DURATION},
                                        "labels": {
                                            "type": "object",
                                            "additionalProperties": {"type": "string"},
                                        },
                                        "annotations": {
                                            "type": "object",
                                            "additionalProperties": {"type": "string"},
                                        },
                                    },
                                    ("expr",),
                                ),
                                "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                            },
                        },
                    },
                    ("name",),
                ),
            }
        }
    ),
)


# --- HTTPRoute, gateway.networking.k8s.io/v1 ---------------------------------------
# kubernetes-sigs/gateway-api v1.6.1 (8bb74df0), apis/v1/httproute_types.go,
# apis/v1/shared_types.go and config/crd/standard/gateway.networking.k8s.io_httproutes.yaml.
# A subset: parentRefs (at most 32), hostnames, rules (at most 16) with matches (at most
# 64; path type and value), backendRefs (at most 16) and timeouts (Gateway API Duration).
_GW_DURATION = r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"
_NAME: Schema = {"type": "string", "minLength": 1, "maxLength": 253}
_PATH_MATCH: Schema = {
    **_object(
        {
            "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
            "value": {"type": "string", "maxLength": 1024},
        }
    ),
    # The CRD's CEL rules for Exact and PathPrefix (type defaults to PathPrefix): an
    # absolute path of URL path characters, without "//".
    "if": {"not": {"required": ["type"], "properties": {"type": {"const": "RegularExpression"}}}},
    "then": {
        "properties": {
            "value": {
                "pattern": r"^/(?:[-A-Za-z0-9/._~!$&'()*+,;=:@]|%[0-9a-fA-F]{2})*$",
                "not": {"pattern": "//"},
            }
        }
    },
}
_REF_PROPERTIES: dict[str, Schema] = {
    "group": {"type": "string", "maxLength": 253, "pattern": _GROUP},
    "kind": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": _KIND},
    "namespace": {"type": "string", "minLength": 1, "maxLength": 63},
    "name": _NAME,
    "port": _PORT_NUMBER,
}

HTTP_ROUTE_V1 = _resource(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    _object(
        {
            "parentRefs": {
                "type": "array",
                "maxItems": 32,
                "items": _object(
                    {**_REF_PROPERTIES, "sectionName": {"type": "string", "pattern": _DNS_SUBDOMAIN}},
                    ("name",),
                ),
            },
            "hostnames": {"type": "array", "items": {"type": "string"}},
            "rules": {
                "type": "array",
                "maxItems": 16,
                "items": _object(
                    {
                        "matches": {
                            "type": "array",
                            "maxItems": 64,
                            "items": _object({"path": _PATH_MATCH}),
                        },
                        "backendRefs": {
                            "type": "array",
                            "maxItems": 16,
                            "items": _object(
                                {**_REF_PROPERTIES, "weight": {"type": "integer", "minimum": 0}}, ("name",)
                            ),
                        },
                        "timeouts": _object(
                            {
                                "request": {"type": "string", "pattern": _GW_DURATION},
                                "backendRequest": {"type": "string", "pattern": _GW_DURATION},
                            }
                        ),
                    }
                ),
            },
        }
    ),
)


CRD_SCHEMAS: dict[tuple[str, str], Schema] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL_V1,
    ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR_V1,
    ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUS_RULE_V1,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE_V1,
}
"""Schema by ``(apiVersion, kind)``."""
