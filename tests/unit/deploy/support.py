"""What the deploy tests share: the rendered kustomizations, the Dockerfiles, and
the settings each container will run with, derived by the same click commands
and settings classes the images start (never a copy of their defaults)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import click
import yaml

from engine_worker.cli import main as worker_command
from engine_worker.settings import WorkerSettings
from launcher.cli import main as launcher
from protocol.settings import ENV_PREFIX, from_options
from proxy.cli import main as proxy_command
from proxy.settings import ProxySettings
from tests.unit.deploy.kustomize import Obj, render, split_image

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "deploy" / "k8s"
DOCKER = REPO / "deploy" / "docker"
KUSTOMIZATIONS = tuple(sorted(p.parent for p in K8S.rglob("kustomization.yaml")))
OVERLAYS = tuple(sorted(p for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file()))
ADDONS = K8S / "addons"
IMAGE_PREFIX = "exl3-sidecar-"
"""Our images are ``exl3-sidecar-<stem>``, built from ``deploy/docker/<stem>.Dockerfile``."""

SECRET_PLACEHOLDER = "value-from-a-secret"
"""What an env var taken from a Secret or a field holds when the tests parse it."""


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@functools.cache
def rendered(directory: Path) -> tuple[Obj, ...]:
    """The objects of a kustomization (cached: treat as read-only, copy to change)."""
    return tuple(render(directory))


def find(objs: tuple[Obj, ...] | list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs: tuple[Obj, ...] | list[Obj], kind: str, name: str | None = None) -> Obj:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def model_server(objs: tuple[Obj, ...] | list[Obj]) -> Obj:
    """The Deployment whose pods run the worker and the proxy."""
    return one(objs, "Deployment", "exl3-sidecar")


def pod_spec(deployment: Obj) -> Obj:
    spec: Obj = deployment["spec"]["template"]["spec"]
    return spec


def containers(deployment: Obj) -> dict[str, Obj]:
    return {c["name"]: c for c in pod_spec(deployment)["containers"]}


def container_port(container: Obj, port: int | str) -> int:
    """A port of ``container`` by number or name, as probes and Services refer to it."""
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return int(p["containerPort"])
    raise AssertionError(f"container {container['name']} has no port {port!r}")


# --- Dockerfiles ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Dockerfile:
    path: Path
    text: str

    @property
    def instructions(self) -> list[tuple[str, str]]:
        """``(INSTRUCTION, arguments)`` after the first FROM, continuation lines joined."""
        joined = re.sub(r"\\\n\s*", " ", self.text)
        lines = [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        out = [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]
        first_from = next(i for i, (ins, _) in enumerate(out) if ins == "FROM")
        return out[first_from:]

    @property
    def entrypoint(self) -> list[str]:
        (value,) = [a for ins, a in self.instructions if ins == "ENTRYPOINT"]
        parsed: list[str] = json.loads(value)
        return parsed

    @property
    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for ins, args in self.instructions:
            if ins == "ENV":
                for part in shlex.split(args):
                    key, _, value = part.partition("=")
                    env[key] = value
        return env

    @property
    def user(self) -> str | None:
        users = [a for ins, a in self.instructions if ins == "USER"]
        return users[-1] if users else None

    @property
    def copied(self) -> set[str]:
        return {m for ins, a in self.instructions if ins == "COPY" for m in re.findall(r"^(\w+) \./\1$", a)}

    def pip_installs(self) -> list[tuple[frozenset[str], frozenset[str]]]:
        """Every ``pip install`` of a RUN, as (requirements, options)."""
        return [cmd for ins, a in self.instructions if ins == "RUN" for cmd in pip_installs(a)]


IGNORED_PIP_OPTIONS = frozenset({"-e", "--editable", "--no-cache-dir"})
"""Options that change where or how a package lands, not what is installed: an image
installs non-editable and keeps no cache; a developer's venv installs editable."""


def pip_installs(shell: str) -> list[tuple[frozenset[str], frozenset[str]]]:
    """``(requirements, options)`` of each ``pip install`` in a shell command line."""
    out = []
    # The shell's own splitting: an operator inside quotes (python -c '...; ...') is text.
    lexer = shlex.shlex(shell, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", ";", "||", "|", "&"):
            commands.append([])
        else:
            commands[-1].append(token)
    for words in commands:
        for i, word in enumerate(words[:-1]):
            if word.endswith("pip") and words[i + 1] == "install":
                args = words[i + 2 :]
                reqs = frozenset(a for a in args if not a.startswith("-"))
                opts = frozenset(a for a in args if a.startswith("-")) - IGNORED_PIP_OPTIONS
                out.append((reqs, opts))
    return out


def dockerfile_of(image: str) -> Dockerfile:
    """The Dockerfile an ``exl3-sidecar-*`` image is built from."""
    name, _, _ = split_image(image)
    assert name.startswith(IMAGE_PREFIX), f"{image}: not one of our images ({IMAGE_PREFIX}*)"
    path = DOCKER / f"{name.removeprefix(IMAGE_PREFIX)}.Dockerfile"
    assert path.is_file(), f"{image}: no {rel(path)} builds it"
    return Dockerfile(path, path.read_text())


def dockerfiles() -> list[Dockerfile]:
    return [Dockerfile(p, p.read_text()) for p in sorted(DOCKER.glob("*.Dockerfile"))]


# --- what a container runs -----------------------------------------------------


def env_of(container: Obj) -> dict[str, str]:
    """The container's environment: its image's ENV, then the pod's (which wins);
    values from Secrets and fields become ``SECRET_PLACEHOLDER``."""
    env = dict(dockerfile_of(container["image"]).env)
    for e in container.get("env", []):
        env[e["name"]] = str(e["value"]) if "value" in e else SECRET_PLACEHOLDER
    return env


@dataclasses.dataclass(frozen=True)
class Process:
    """The command a container starts and the settings it will parse."""

    command: click.Command
    args: tuple[str, ...]
    settings_cls: type[Any]


def process_of(container: Obj) -> Process:
    """What the container's image (or its ``command``/``args``) starts."""
    argv = list(container.get("command") or dockerfile_of(container["image"]).entrypoint)
    argv += container.get("args", [])
    if argv[:1] == ["exl3-sidecar"]:
        command = launcher.commands[argv[1]]  # type: ignore[attr-defined]
        args = argv[2:]
    elif argv[:3] == ["python", "-m", "engine_worker"]:
        command, args = worker_command, argv[3:]
    elif argv[:3] == ["python", "-m", "proxy"]:
        command, args = proxy_command, argv[3:]
    else:
        raise AssertionError(f"container {container['name']}: unknown command {argv}")
    if command is proxy_command:
        return Process(command, tuple(args), ProxySettings)
    if command is worker_command:
        return Process(command, tuple(args), WorkerSettings)
    raise AssertionError(f"container {container['name']}: {argv} is neither the proxy nor the worker")


def envvars_of(command: click.Command) -> set[str]:
    return {p.envvar for p in command.params if isinstance(p, click.Option) and isinstance(p.envvar, str)}


@functools.cache
def _settings(
    command: click.Command, cls: type[Any], args: tuple[str, ...], env: tuple[tuple[str, str], ...]
) -> Any:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)} | dict(env)
    with mock.patch.dict(os.environ, environ, clear=True):
        ctx = command.make_context(command.name or "command", list(args))
    return from_options(cls, ctx.params)


def settings_of(container: Obj) -> Any:
    """The ``ProxySettings`` or ``WorkerSettings`` the container's process will run
    with: its command line and environment parsed by that process's own click
    command. Raises ``click.UsageError`` (or another click error) for a bad value."""
    p = process_of(container)
    env = tuple(sorted((k, v) for k, v in env_of(container).items() if k.startswith(ENV_PREFIX)))
    return _settings(p.command, p.settings_cls, p.args, env)


def iter_strings(node: Any) -> Iterator[str]:
    """Every string in a YAML tree, keys included."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from iter_strings(k)
            yield from iter_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from iter_strings(v)
    elif isinstance(node, str):
        yield node


def yaml_documents(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
