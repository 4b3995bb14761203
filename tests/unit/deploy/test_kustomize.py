"""The test renderer (``kustomize.py``) does what kustomize does for the features
``deploy/k8s/`` uses, refuses the rest, and (where kubectl is installed) renders
every kustomization exactly as ``kubectl kustomize`` does."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.deploy.kustomize import MERGE_KEYS, KustomizeError, render, split_image, strategic_merge
from tests.unit.deploy.support import K8S, KUSTOMIZATIONS, rendered


def _write(root: Path, files: dict[str, Any]) -> Path:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        text = (
            content
            if isinstance(content, str)
            else yaml.safe_dump_all(content if isinstance(content, list) else [content])
        )
        path.write_text(text)
    return root


DEPLOYMENT = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "d"},
    "spec": {
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "a",
                        "image": "registry.local:5000/team/a:1",
                        "args": ["--x"],
                        "env": [{"name": "K", "value": "1"}],
                        "volumeMounts": [{"name": "v", "mountPath": "/v"}],
                        "ports": [{"containerPort": 80, "name": "http"}],
                    },
                    {"name": "b", "image": "b"},
                ],
                "volumes": [{"name": "v", "emptyDir": {}}],
            }
        }
    },
}


def test_strategic_merge_by_merge_keys() -> None:
    patch = {
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "a",
                            "args": ["--y"],
                            "env": [{"name": "K", "value": "2"}, {"name": "L", "value": "3"}],
                            "volumeMounts": [{"name": "w", "mountPath": "/v", "readOnly": True}],
                            "ports": [{"containerPort": 80, "protocol": "TCP"}],
                            "resources": {"limits": {"memory": "1Gi"}},
                        }
                    ],
                    "volumes": [{"name": "x", "emptyDir": {}}],
                    "tolerations": [{"key": "k", "operator": "Exists"}],
                }
            }
        }
    }
    merged = strategic_merge(DEPLOYMENT, patch)
    a, b = merged["spec"]["template"]["spec"]["containers"]
    assert a["args"] == ["--y"]  # a list without a merge key is replaced
    assert a["env"] == [{"name": "K", "value": "2"}, {"name": "L", "value": "3"}]
    assert a["volumeMounts"] == [{"name": "w", "mountPath": "/v", "readOnly": True}]
    assert a["ports"] == [{"containerPort": 80, "name": "http", "protocol": "TCP"}]
    assert a["resources"] == {"limits": {"memory": "1Gi"}}
    assert b == {"name": "b", "image": "b"}
    assert [v["name"] for v in merged["spec"]["template"]["spec"]["volumes"]] == ["v", "x"]
    assert DEPLOYMENT["spec"]["template"]["spec"]["containers"][0]["args"] == ["--x"]  # not mutated


def test_strategic_merge_null_deletes_and_directives_are_refused() -> None:
    merged = strategic_merge({"a": 1, "b": {"c": 2}}, {"a": None, "b": {"d": 3}})
    assert merged == {"b": {"c": 2, "d": 3}}
    with pytest.raises(KustomizeError, match="directive"):
        strategic_merge(
            DEPLOYMENT, {"spec": {"template": {"spec": {"containers": [{"name": "a", "$patch": "delete"}]}}}}
        )
    with pytest.raises(KustomizeError, match="merge key"):
        strategic_merge({"env": [{"name": "a"}]}, {"env": [{"value": "1"}]})


def test_merge_keys_are_the_apis() -> None:
    # k8s.io/api core/v1 types.go: patchMergeKey of each list field.
    assert MERGE_KEYS["containers"] == ("name",) and MERGE_KEYS["volumeMounts"] == ("mountPath",)


@pytest.mark.parametrize(
    ("image", "parts"),
    [
        ("a", ("a", None, None)),
        ("a:1", ("a", "1", None)),
        ("registry.local:5000/team/a", ("registry.local:5000/team/a", None, None)),
        ("registry.local:5000/team/a:1@sha256:ff", ("registry.local:5000/team/a", "1", "sha256:ff")),
    ],
)
def test_split_image(image: str, parts: tuple[str, str | None, str | None]) -> None:
    assert split_image(image) == parts


def test_render_resources_patches_images(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "base/kustomization.yaml": {
                "resources": ["d.yaml"],
                "images": [{"name": "b", "newTag": "2"}],
            },
            "base/d.yaml": DEPLOYMENT,
            "over/kustomization.yaml": {
                "resources": ["../base", "cm.yaml"],
                "patches": [{"path": "p.yaml"}],
                "images": [
                    {"name": "registry.local:5000/team/a", "newName": "a2", "newTag": "3"},
                    {"name": "b", "digest": "sha256:aa"},
                ],
            },
            "over/cm.yaml": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}},
            "over/p.yaml": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "metadata": {"name": "d"},
                "spec": {"replicas": 2},
            },
        },
    )
    d, cm = render(tmp_path / "over")
    assert cm["kind"] == "ConfigMap"
    assert d["spec"]["replicas"] == 2
    assert [c["image"] for c in d["spec"]["template"]["spec"]["containers"]] == ["a2:3", "b@sha256:aa"]


@pytest.mark.parametrize(
    ("kustomization", "files", "error"),
    [
        ({"resources": ["d.yaml"], "namePrefix": "x-"}, {}, "not supported"),
        ({"resources": ["https://example.com/d.yaml"]}, {}, "remote"),
        ({"resources": ["missing.yaml"]}, {}, "not found"),
        ({"resources": ["d.yaml", "d2.yaml"]}, {"d2.yaml": DEPLOYMENT}, "twice"),
        ({"resources": ["d.yaml"], "patches": [{"path": "p.yaml"}]},
         {"p.yaml": {**DEPLOYMENT, "metadata": {"name": "other"}}}, "matches 0"),
        ({"resources": ["d.yaml"], "patches": [{"path": "p.yaml", "target": {"kind": "Deployment"}}]},
         {"p.yaml": DEPLOYMENT}, "path alone"),
        ({"resources": ["d.yaml"], "images": [{"name": "a", "newImage": "b"}]}, {}, "not supported"),
        ({"kind": "Component", "resources": ["d.yaml"]}, {}, "components"),
    ],
)  # fmt: skip
def test_render_refuses_what_it_does_not_do(
    tmp_path: Path, kustomization: dict[str, Any], files: dict[str, Any], error: str
) -> None:
    _write(tmp_path, {"kustomization.yaml": kustomization, "d.yaml": DEPLOYMENT, **files})
    with pytest.raises(KustomizeError, match=error):
        render(tmp_path)


def _normalized(node: Any, field: str = "") -> Any:
    """Lists merged by key compared as sets: kustomize puts patch-only items first."""
    if isinstance(node, dict):
        return {k: _normalized(v, k) for k, v in node.items()}
    if isinstance(node, list):
        items = [_normalized(v) for v in node]
        keys = [
            k
            for k in MERGE_KEYS.get(field, ())
            if items and all(isinstance(i, dict) and k in i for i in items)
        ]
        return sorted(items, key=lambda i: str(i[keys[0]])) if keys else items
    return node


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (its built-in kustomize) not installed")
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_renders_as_kubectl_kustomize(directory: Path) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    theirs = sorted(
        (_normalized(d) for d in yaml.safe_load_all(out) if d),
        key=lambda o: (o["kind"], o["metadata"]["name"]),
    )
    ours = sorted(
        (_normalized(d) for d in rendered(directory)), key=lambda o: (o["kind"], o["metadata"]["name"])
    )
    assert ours == theirs
