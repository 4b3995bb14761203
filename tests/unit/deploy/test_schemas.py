"""Every object of every kustomization under ``deploy/k8s/`` validates against its
API: built-in kinds with kubernetes-validate's strict schemas (unknown fields
fail) for the oldest Kubernetes these manifests support and the newest the
package ships, custom resources with ``crd_schemas``. Offline: both ship their
schemas."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from tests.unit.deploy.crd_schemas import CRD_SCHEMAS
from tests.unit.deploy.kustomize import Obj
from tests.unit.deploy.support import K8S, KUSTOMIZATIONS, rendered

OLDEST_KUBERNETES = "1.30"
"""The preStop ``sleep`` action is on by default from 1.30 (beta; GA in 1.34, KEP-3960)."""

VERSIONS = (OLDEST_KUBERNETES, kubernetes_validate.latest_version())


def validate(obj: Obj, version: str) -> None:
    """Raises ``jsonschema.ValidationError`` (kubernetes-validate's is one) when
    ``obj`` does not fit its API, ``AssertionError`` when no schema is known."""
    schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if schema is not None:
        jsonschema.Draft202012Validator(schema).validate(obj)
        return
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        raise AssertionError(
            f"no schema for {obj['apiVersion']} {obj['kind']}: add one to crd_schemas.py"
        ) from None


def test_the_schemas_are_valid_json_schemas() -> None:
    for schema in CRD_SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_object_fits_its_api(directory: Path, version: str) -> None:
    objs = rendered(directory)
    assert objs, f"{directory}: renders nothing"
    for obj in objs:
        try:
            validate(obj, version)
        except jsonschema.ValidationError as e:
            where = ".".join(str(p) for p in e.absolute_path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {e.message}")


def _first(kind: str) -> Obj:
    """The first object of ``kind`` (the model server's for a Deployment)."""
    for d in KUSTOMIZATIONS:
        for obj in rendered(d):
            if obj["kind"] == kind and (kind != "Deployment" or obj["metadata"]["name"] == "exl3-sidecar"):
                return copy.deepcopy(obj)
    raise AssertionError(f"no {kind} in deploy/k8s")


def _set(obj: Any, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for p in parents:
        obj = obj[int(p)] if isinstance(obj, list) else obj[p]
    if isinstance(obj, list):
        obj[int(last)] = value
    elif value is _DELETE:
        del obj[last]
    else:
        obj[last] = value


_DELETE = object()

BROKEN = [
    ("Deployment", "spec.template.spec.containers.0.readinessProbes", {}),
    ("Deployment", "spec.template.spec.containers.0.lifecycle.preStop.sleep", {"second": 5}),
    ("Deployment", "spec.strategy.rollingUpdate.maxSurge", [1]),
    ("HorizontalPodAutoscaler", "spec.scaleTargetRef.name", _DELETE),
    ("HorizontalPodAutoscaler", "spec.metrics.0.pods.target.averageValue", ["2"]),
    ("PodDisruptionBudget", "spec.maxUnavailble", 1),
    ("InferencePool", "spec.targetPort", [{"number": 5000}]),
    ("InferencePool", "spec.targetPorts", [{"number": 5000}, {"number": 5000}]),
    ("InferencePool", "spec.targetPorts", []),
    ("InferencePool", "spec.endpointPickerRef.port", _DELETE),
    ("InferencePool", "spec.endpointPickerRef.failureMode", "FailOpenly"),
    ("InferencePool", "spec.selector", {"matchExpressions": []}),
    ("PodMonitor", "spec.podMetricsEndpoints.0.interval", "15 s"),
    ("PodMonitor", "spec.podMetricsEndpoints.0.targetport", "http"),
    ("HTTPRoute", "spec.rules.0.timeouts.request", "10 minutes"),
    ("HTTPRoute", "spec.rules.0.matches.0.path.value", "v1"),
    ("HTTPRoute", "spec.rules.0.backendRefs.0.kind", "Inference Pool"),
]


@pytest.mark.parametrize(("kind", "path", "value"), BROKEN, ids=[f"{k}:{p}" for k, p, _ in BROKEN])
def test_a_broken_object_fails(kind: str, path: str, value: Any) -> None:
    obj = _first(kind)
    validate(obj, OLDEST_KUBERNETES)
    _set(obj, path, value)
    with pytest.raises(jsonschema.ValidationError):
        validate(obj, OLDEST_KUBERNETES)


def test_an_unknown_kind_fails() -> None:
    obj = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {}}
    with pytest.raises(AssertionError, match="no schema"):
        validate(obj, OLDEST_KUBERNETES)
