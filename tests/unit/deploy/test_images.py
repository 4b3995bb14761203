"""What a change rebuilds: Docker's layer cache, modelled on the Dockerfiles.

A build reuses each instruction's layer until the first ``COPY`` whose sources hold
a changed file; that instruction and every later one in its stage run again (and a
stage that copies ``--from`` it, from that ``COPY`` on). ``rebuilt`` applies that rule
(Docker's documented cache invalidation for ``COPY``/``ADD``: the files' checksums)
to each Dockerfile, so the tests below show what a one-line change to the source
costs: never the dependency install, the model conversion or the CUDA extension.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re

import pytest

from tests.unit.deploy.support import REPO, Dockerfile, dockerfiles, rel

EXPENSIVE = {
    "dependencies": re.compile(r"pip install .*-r /tmp/locks/"),
    "CUDA extension": re.compile(r"import exllamav3\.ext"),
    "model conversion": re.compile(r"engine_worker\.cpu\.model_store"),
    "apt packages": re.compile(r"apt-get install"),
}
"""Steps that take minutes (the CUDA extension: tens of minutes per architecture)."""


@dataclasses.dataclass(frozen=True)
class Step:
    stage: str
    index: int
    instruction: str
    args: str


def _steps(df: Dockerfile) -> list[Step]:
    steps: list[Step] = []
    stage = ""
    for i, (ins, args) in enumerate(df.instructions):
        if ins == "FROM":
            m = re.search(r" AS (\w+)$", args)
            stage = m.group(1) if m else f"stage{i}"
        steps.append(Step(stage, i, ins, args))
    return steps


def _sources(step: Step) -> list[str]:
    words = [w for w in step.args.split() if not w.startswith("--")]
    return words[:-1]


def _copies(step: Step, path: str) -> bool:
    if step.instruction not in ("COPY", "ADD") or "--from=" in step.args:
        return False
    return any(
        path == src.rstrip("/") or path.startswith(src.rstrip("/") + "/") or fnmatch.fnmatch(path, src)
        for src in _sources(step)
    )


def rebuilt(df: Dockerfile, path: str) -> list[Step]:
    """The steps a change to ``path`` (relative to the build context) runs again."""
    steps = _steps(df)
    dirty: set[str] = set()
    out: list[Step] = []
    for step in steps:
        if step.instruction == "FROM":
            continue
        from_stage = re.search(r"--from=(\w+)", step.args)
        if step.stage in dirty or _copies(step, path) or (from_stage and from_stage.group(1) in dirty):
            dirty.add(step.stage)
            out.append(step)
    return out


def _expensive(steps: list[Step]) -> set[str]:
    return {
        name
        for name, pattern in EXPENSIVE.items()
        for s in steps
        if s.instruction == "RUN" and pattern.search(s.args)
    }


SOURCE_CHANGES = ["engine_worker/loop.py", "protocol/messages.py", "proxy/ops/routes.py", "README.md"]


@pytest.mark.parametrize("df", dockerfiles(), ids=lambda d: d.path.name)
@pytest.mark.parametrize("path", SOURCE_CHANGES)
def test_a_source_change_rebuilds_no_expensive_step(df: Dockerfile, path: str) -> None:
    assert (REPO / path).is_file()
    steps = rebuilt(df, path)
    expensive = _expensive(steps) - ({"model conversion"} if path.startswith("protocol/") else set())
    assert not expensive, f"{rel(df.path)}: a change to {path} reruns {sorted(expensive)}"
    for s in steps:
        print(f"{df.path.name}: {path} reruns {s.instruction} {s.args[:90]}")


@pytest.mark.parametrize("df", dockerfiles(), ids=lambda d: d.path.name)
def test_a_lock_change_reinstalls_the_dependencies(df: Dockerfile) -> None:
    """The model can fail: changing what a dependency layer copies reruns it."""
    (lock,) = {m for _, a in df.instructions for m in re.findall(r"deploy/docker/locks/[\w-]+\.txt", a)} & {
        f"deploy/docker/locks/{df.path.name.removesuffix('.Dockerfile')}.txt"
    }
    assert "dependencies" in _expensive(rebuilt(df, lock))


def test_engine_worker_change_in_the_gpu_image_reruns_only_the_last_copy_and_install() -> None:
    (df,) = [d for d in dockerfiles() if d.path.name == "worker-exllamav3.Dockerfile"]
    steps = rebuilt(df, "engine_worker/loop.py")
    assert [(s.instruction, s.args) for s in steps] == [
        ("COPY", "engine_worker ./engine_worker"),
        ("RUN", "pip install --no-cache-dir --no-deps --no-build-isolation ."),
        ("USER", "10001"),
        ("ENTRYPOINT", '["python", "-m", "engine_worker", "--backend", "exllamav3"]'),
    ]
