"""The container images agree with the code and the README: each image carries
only its own process's package and runs an existing command as the pod's
non-root user, installs exactly what the README's commands install (the proxy
the base install, which has no torch), and every image a manifest names is
built by one of them. The pods and add-ons are checked in ``tests/unit/deploy/``."""

from __future__ import annotations

import re
import tomllib

from launcher.cli import main as launcher
from tests.unit.deploy.kustomize import split_image
from tests.unit.deploy.support import (
    DOCKER,
    IMAGE_PREFIX,
    KUSTOMIZATIONS,
    REPO,
    Dockerfile,
    dockerfile_of,
    find,
    pip_installs,
    pod_spec,
    rel,
    rendered,
)

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
ENGINE_PACKAGES = ("torch", "transformers", "exllamav3")


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


def test_proxy_image_is_the_base_install_without_torch() -> None:
    assert _image("proxy").pip_installs() == [(frozenset({"."}), frozenset())], "the base install: no extras"
    base = {_requirement_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert not base & set(ENGINE_PACKAGES), f"the base install pulls {sorted(base & set(ENGINE_PACKAGES))}"
    text = _image("proxy").text.split("FROM", 1)[1]
    assert not re.search(r"^[^#]*\btorch\b", text, re.M), "torch named outside comments"


def test_cpu_worker_image_installs_what_the_readme_serve_command_installs() -> None:
    readme = set(pip_installs(_readme_block("serve-command")))
    image = set(_image("worker-cpu").pip_installs())
    assert image == readme, f"image {sorted(image)} != README {sorted(readme)}"
    extras = {e for reqs, _ in image for r in reqs if r.startswith(".[") for e in r[2:-1].split(",")}
    assert extras == {"cpu"}
    assert extras <= set(PYPROJECT["project"]["optional-dependencies"])


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
