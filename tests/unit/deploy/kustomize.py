"""Renders a kustomization the way ``kubectl apply -k`` does, for the subset of
kustomize that ``deploy/k8s/`` uses, so CI can check the objects an overlay
really produces without the kustomize binary.

Supported, with kustomize's semantics (https://kubectl.docs.kubernetes.io/references/kustomize/kustomization/):

- ``resources``: YAML files (several documents each) and directories holding a
  ``kustomization.yaml``, rendered first; each kustomization's own
  transformations apply to everything it has accumulated.
- ``patches`` with ``path``: a strategic-merge patch (its ``kind`` and
  ``metadata.name`` pick the target). Maps merge recursively, ``null`` deletes a
  key; lists of objects merge by their Kubernetes patch merge key (containers,
  volumes, env, ... by ``name``, volumeMounts by ``mountPath``, container ports by
  ``containerPort``), patch-only items appended; every other list is replaced.
  ``$patch`` directives are refused.
- ``images``: ``name`` with ``newName``, ``newTag`` or ``digest``, on the
  containers and init containers of pod templates.

Anything else (another field, a remote resource, a JSON6902 patch, a patch that
matches nothing, two objects with one id) raises ``KustomizeError`` rather than
render something kustomize would not. ``test_kustomize.py`` compares the result
with ``kubectl kustomize`` where kubectl is installed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

SUPPORTED_FIELDS = frozenset({"apiVersion", "kind", "resources", "patches", "images"})

MERGE_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "ephemeralContainers": ("name",),
    "env": ("name",),
    "envFrom": (),  # no merge key in the API: replaced
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "volumeDevices": ("devicePath",),
    "imagePullSecrets": ("name",),
    # Container ports merge by containerPort, Service ports by port.
    "ports": ("containerPort", "port"),
}
"""Patch merge keys of the list fields (``patchMergeKey`` in the Kubernetes API);
a list field not named here is replaced whole, as in a strategic merge."""

POD_TEMPLATE_PATHS: dict[str, tuple[str, ...]] = {
    "Deployment": ("spec", "template", "spec"),
    "StatefulSet": ("spec", "template", "spec"),
    "DaemonSet": ("spec", "template", "spec"),
    "ReplicaSet": ("spec", "template", "spec"),
    "Job": ("spec", "template", "spec"),
    "CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
    "Pod": ("spec",),
}


class KustomizeError(Exception):
    """A kustomization this renderer cannot render faithfully, or that kustomize would refuse."""


def render(directory: Path) -> list[Obj]:
    """The objects ``kubectl kustomize directory`` prints, in resource order."""
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{directory}: no kustomization.yaml")
    k = yaml.safe_load(path.read_text()) or {}
    unsupported = set(k) - SUPPORTED_FIELDS
    if unsupported:
        raise KustomizeError(f"{path}: {sorted(unsupported)} not supported by this renderer")
    if k.get("kind", "Kustomization") != "Kustomization":
        raise KustomizeError(f"{path}: kind {k['kind']!r} (components are not supported)")

    objects: list[Obj] = []
    for entry in k.get("resources") or []:
        if "://" in entry or entry.startswith("github.com/"):
            raise KustomizeError(f"{path}: remote resource {entry!r}")
        target = (directory / entry).resolve()
        if target.is_dir():
            objects.extend(render(target))
        elif target.is_file():
            objects.extend(load_documents(target))
        else:
            raise KustomizeError(f"{path}: resource {entry!r} not found")
    _check_unique(objects, path)

    for patch_entry in k.get("patches") or []:
        if set(patch_entry) != {"path"}:
            raise KustomizeError(f"{path}: only patches with a path alone are supported: {patch_entry}")
        (patch,) = load_documents(directory / patch_entry["path"])
        _apply_patch(objects, patch, directory / patch_entry["path"])

    for image in k.get("images") or []:
        _apply_image(objects, image, path)
    return objects


def load_documents(path: Path) -> list[Obj]:
    """The non-empty YAML documents of ``path``."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def object_id(obj: Obj) -> tuple[str, str, str, str]:
    """``(apiVersion group, kind, namespace, name)``: what kustomize keys resources by."""
    group = obj["apiVersion"].rsplit("/", 1)[0] if "/" in obj["apiVersion"] else ""
    meta = obj.get("metadata") or {}
    return group, obj["kind"], meta.get("namespace", ""), meta["name"]


def _check_unique(objects: list[Obj], where: Path) -> None:
    seen: set[tuple[str, str, str, str]] = set()
    for obj in objects:
        oid = object_id(obj)
        if oid in seen:
            raise KustomizeError(f"{where}: {oid} defined twice")
        seen.add(oid)


def _apply_patch(objects: list[Obj], patch: Obj, where: Path) -> None:
    pid = object_id(patch)
    matches = [i for i, obj in enumerate(objects) if object_id(obj)[1:] == pid[1:]]
    if len(matches) != 1:
        raise KustomizeError(f"{where}: patch target {pid[1:]} matches {len(matches)} objects")
    (i,) = matches
    objects[i] = strategic_merge(objects[i], patch)


def strategic_merge(original: Any, patch: Any, field: str = "") -> Any:
    """``patch`` merged into a copy of ``original`` (see the module docstring)."""
    if isinstance(patch, dict):
        if "$patch" in patch or any(str(key).startswith("$") for key in patch):
            raise KustomizeError(f"{field}: patch directives are not supported: {sorted(patch)}")
        if not isinstance(original, dict):
            return copy.deepcopy(patch)
        merged = copy.deepcopy(original)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    if isinstance(patch, list) and isinstance(original, list) and MERGE_KEYS.get(field):
        return _merge_list(original, patch, field)
    return copy.deepcopy(patch)


def _merge_key(items: list[Any], field: str) -> str:
    for key in MERGE_KEYS[field]:
        if items and all(isinstance(item, dict) and key in item for item in items):
            return key
    raise KustomizeError(f"{field}: items without a merge key {MERGE_KEYS[field]}: {items}")


def _merge_list(original: list[Any], patch: list[Any], field: str) -> list[Any]:
    if not original or not patch:
        return copy.deepcopy(original or patch)
    key = _merge_key(original + patch, field)
    merged = copy.deepcopy(original)
    index = {item[key]: i for i, item in enumerate(merged)}
    for item in patch:
        if item[key] in index:
            merged[index[item[key]]] = strategic_merge(merged[index[item[key]]], item)
        else:
            merged.append(copy.deepcopy(item))
    return merged


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """``(name, tag, digest)`` of an image reference (a registry port is part of the name)."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    return name, tag, digest or None


def _apply_image(objects: list[Obj], image: Obj, where: Path) -> None:
    unknown = set(image) - {"name", "newName", "newTag", "digest"}
    if unknown or "name" not in image:
        raise KustomizeError(f"{where}: images entry {image} not supported")
    for obj in objects:
        spec_path = POD_TEMPLATE_PATHS.get(obj["kind"])
        if spec_path is None:
            continue
        spec: Any = obj
        for part in spec_path:
            spec = spec.get(part) or {}
        for container in [*spec.get("containers", []), *spec.get("initContainers", [])]:
            name, tag, digest = split_image(container["image"])
            if name != image["name"]:
                continue
            name = image.get("newName", name)
            if "digest" in image:
                tag, digest = None, image["digest"]
            elif "newTag" in image:
                tag, digest = str(image["newTag"]), None
            container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
