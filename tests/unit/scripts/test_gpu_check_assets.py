"""The wheels the GPU check carries: the list is well formed, agrees with pyproject.toml,
and covers every requirement the GPU machine's image lacks; the download command, the
wheel check and the git exclude line."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from scripts import gpu_check_assets as assets

ROOT = Path(assets.__file__).resolve().parents[1]

EXLLAMAV3_REQUIRES = [
    "torch>=2.6.0",
    "tokenizers>=0.21.1",
    "numpy>=2.1.0",
    "rich",
    "typing_extensions",
    "safetensors>=0.3.2",
    "ninja",
    "pillow",
    "pyyaml",
    "marisa_trie",
    "pydantic",
    "llguidance>=1.7.0",
]
"""``Requires-Dist`` of the exllamav3 1.6.5 wheel's METADATA (Windows-only and extras left out)."""
PYDANTIC_REQUIRES = ("annotated-types", "pydantic-core", "typing-extensions", "typing-inspection")
"""``Requires-Dist`` of pydantic 2.14.4."""


def _project() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"], *project["optional-dependencies"]["exllamav3"]]
    out: dict[str, list[Requirement]] = {}
    for s in specs:
        r = Requirement(s)
        out.setdefault(assets.normalize(r.name), []).append(r)
    return out


def test_the_list_parses_into_one_pin_per_package() -> None:
    pins = assets.read_pins()
    assert pins["exllamav3"] == "1.6.5" and len(pins) >= 12


@pytest.mark.parametrize(
    "line", ["exllamav3>=1.6", "exllamav3 == 1.6.5 x", "exllamav3==1.6.5\nExllamaV3==1.6.5"]
)
def test_a_bad_list_is_refused(tmp_path: Path, line: str) -> None:
    bad = tmp_path / "wheels.txt"
    bad.write_text(f"# header\n{line}\n")
    with pytest.raises(ValueError, match=r"wheels\.txt:\d"):
        assets.read_pins(bad)


def test_pins_agree_with_pyproject() -> None:
    project = _project()
    for name, version in assets.read_pins().items():
        for r in project.get(name, []):
            assert r.specifier.contains(version), f"{name}=={version} vs pyproject {r}"


def test_every_requirement_is_on_the_machine_or_in_the_list() -> None:
    needed = {assets.normalize(Requirement(s).name) for s in EXLLAMAV3_REQUIRES}
    needed |= {assets.normalize(n) for n in PYDANTIC_REQUIRES}
    needed |= set(_project())
    pins = set(assets.read_pins())
    missing = sorted(n for n in needed if n not in assets.DEVICE_HAS and n not in pins)
    assert not missing, f"add to {assets.WHEEL_LIST.name}: {missing}"


def test_the_download_names_the_machines_python_and_platforms(tmp_path: Path) -> None:
    pins = {"exllamav3": "1.6.5", "pyzmq": "27.3.0"}
    cmd = assets.download_command(pins, tmp_path, python="python3")
    assert cmd[:4] == ["python3", "-m", "pip", "download"]
    for flag in ("--no-deps", "--only-binary=:all:"):
        assert flag in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[cmd.index("--implementation") + 1] == "cp"
    platforms = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"]
    assert "manylinux_2_28_x86_64" in platforms and all(p.endswith("x86_64") for p in platforms)
    assert cmd[cmd.index("-d") + 1] == str(tmp_path) and cmd[-2:] == ["exllamav3==1.6.5", "pyzmq==27.3.0"]


def test_the_wheel_check_wants_exactly_the_pinned_wheels(tmp_path: Path) -> None:
    pins = {"pydantic-core": "2.50.5", "click": "8.5.1"}
    (tmp_path / "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl").write_text("")
    (tmp_path / "click-8.5.1-py3-none-any.whl").write_text("")
    assert assets.check_wheels(tmp_path, pins) == []
    (tmp_path / "click-8.4.0-py3-none-any.whl").write_text("")
    (tmp_path / "extra_pkg-1.0-py3-none-any.whl").write_text("")
    problems = assets.check_wheels(tmp_path, pins)
    assert problems == ["click==8.5.1: found ['8.4.0', '8.5.1']", "extra-pkg: not in gpu_check_wheels.txt"]


def test_the_exclude_line_is_added_once(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    exclude = assets.exclude_file(tmp_path)
    assert exclude == (tmp_path / ".git" / "info" / "exclude").resolve()
    assert assets.ensure_excluded(exclude) is True
    assert assets.ensure_excluded(exclude) is False
    assert exclude.read_text().splitlines().count("/.whl/") == 1
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "a.whl").write_text("")
    status = subprocess.run(
        ["git", "status", "--porcelain", "--ignored"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "!! .whl/" in status
