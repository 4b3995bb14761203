"""The ExLlamaV3 worker image installs versions that agree: with pyproject.toml, and
torch with the CUDA toolkit that compiles exllamav3's extension at build time."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[4]
IMAGE = ROOT / "deploy" / "docker" / "worker-exllamav3.Dockerfile"
LOCK = ROOT / "deploy" / "docker" / "locks" / "worker-exllamav3.txt"

TORCH_WHEEL_CUDA = {"2.13.0": "13.0"}
"""CUDA of torch's PyPI wheel for Linux, from its metadata (``Requires-Dist:
cuda-toolkit[...]==13.0.3`` for 2.13.0). A torch pin without an entry here has not been
checked against the image's CUDA."""


def _text() -> str:
    return IMAGE.read_text()


def _image_pins() -> dict[str, str]:
    """``name==version`` pins of the image's ``pip install`` lines and of the lock it
    installs (one version per name)."""
    assert "-r /tmp/locks/worker-exllamav3.txt" in _text(), "the image does not install its lock"
    pins: dict[str, str] = {}
    lock_lines = [ln for ln in LOCK.read_text().splitlines() if not ln.startswith((" ", "#"))]
    for line in [*re.findall(r"pip install[^\n]*", _text()), *lock_lines]:
        for name, version in re.findall(r"\b([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+]*)", line):
            key = canonicalize_name(name)
            assert pins.setdefault(key, version) == version, f"{key} pinned twice with different versions"
    return pins


def _project_requirements() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs: dict[str, list[Requirement]] = {}
    for spec in [
        *project["dependencies"],
        *(s for extra in project["optional-dependencies"].values() for s in extra),
    ]:
        r = Requirement(spec)
        reqs.setdefault(canonicalize_name(r.name), []).append(r)
    return reqs


def test_every_pin_satisfies_pyproject() -> None:
    reqs = _project_requirements()
    for name, version in _image_pins().items():
        for r in reqs.get(name, []):
            assert r.specifier.contains(version, prereleases=True), (
                f"image {name}=={version} vs pyproject {r}"
            )


def test_torch_and_the_exllamav3_extra_are_all_pinned() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "exllamav3"
    ]
    pins = _image_pins()
    for name in ["torch", *(Requirement(s).name for s in extra)]:
        assert canonicalize_name(name) in pins, f"{name} is not pinned in {IMAGE.name}"


def test_the_cuda_toolkit_is_the_one_torch_was_built_for() -> None:
    torch = _image_pins()["torch"]
    assert torch in TORCH_WHEEL_CUDA, f"check torch {torch}'s CUDA and add it to TORCH_WHEEL_CUDA"
    # The images are build arguments (pinned by digest, no default): the example command
    # names the ones this Dockerfile is written for.
    m = re.search(r"CUDA_DEVEL_IMAGE=nvidia/cuda:(\d+)\.(\d+)\.\d+-devel-ubuntu24\.04@sha256:", _text())
    assert m, "the build stage must be a CUDA devel image: the extension is compiled with its nvcc"
    assert f"{m.group(1)}.{m.group(2)}" == TORCH_WHEEL_CUDA[torch]
    r = re.search(r"CUDA_RUNTIME_IMAGE=nvidia/cuda:(\d+)\.(\d+)\.\d+-base-ubuntu24\.04@sha256:", _text())
    assert r and r.groups() == m.groups(), "run on the CUDA (and Ubuntu) the build stage compiled for"
    assert re.search(r"^FROM \$\{CUDA_DEVEL_IMAGE\} AS build$", _text(), re.M)
    assert re.search(r"^FROM \$\{CUDA_RUNTIME_IMAGE\}$", _text(), re.M)
    assert "COPY --from=build /opt/venv /opt/venv" in _text()


def test_the_extension_is_built_in_the_image_for_the_listed_architectures() -> None:
    text = _text()
    assert re.search(r'^ARG TORCH_CUDA_ARCH_LIST="[0-9.;+PTX]+"$', text, re.M)
    env = re.search(r"^ENV (.*?)(?=^\S)", text, re.M | re.S)
    assert env and "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}" in env.group(1)
    build = text.index('python -c "import exllamav3.ext"')
    assert text.index("-r /tmp/locks/worker-exllamav3.txt") < build < text.index("FROM ${CUDA_RUNTIME_IMAGE}")
    # the built library becomes the module exllamav3 imports instead of compiling
    # (exllamav3/ext.py:21-31): no CUDA compilation when a container starts
    step = text[build : text.index("FROM ${CUDA_RUNTIME_IMAGE}")]
    assert "exllamav3_ext*.so" in step and "/exllamav3_ext.so" in step and "platlib" in step
    assert step.rstrip().endswith('python -c "import torch, exllamav3_ext"')


def test_the_runtime_stage_has_what_triton_compiles_with_and_a_cache_for_it() -> None:
    """Triton builds each kernel's C launcher with the system's C compiler against
    Python.h at run time (triton/runtime/build.py), and writes kernels to
    TRITON_CACHE_DIR: the runtime stage keeps gcc and python3-dev, and names a cache
    directory that the pod mounts writable (tests/unit/deploy/test_pod.py)."""
    runtime = _text().split("FROM ${CUDA_RUNTIME_IMAGE}", 1)[1]
    packages = re.search(r"apt-get install -y --no-install-recommends ([^\\&]+)", runtime)
    assert packages and {"gcc", "libc6-dev", "python3-dev"} <= set(packages.group(1).split())
    assert "TRITON_CACHE_DIR=/cache/triton" in runtime
    assert "nvcc" not in runtime and "devel" not in runtime.split("USER")[0].split("ENV")[0]
