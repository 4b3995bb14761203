"""Every line citation of ExLlamaV3's source in our code and docs points at lines that
exist in the pinned ``exllamav3==1.6.5`` wheel, and, where a symbol is named right before
it, at that symbol's definition.

A citation is ``path.py:N``, ``path.py:N-M`` or ``path.py:N,M`` (``path`` a suffix of a
file inside the wheel, e.g. ``job.py`` or ``generator/job.py``), and every bare
backticked ``N`` / ``N-M`` after it in the same paragraph, which cites the same file
(``generator/job.py:21``, ``742-750``). The wheel is the one ``pip download
exllamav3==1.6.5 --no-deps`` fetches (a pure-Python ``py3-none-any`` wheel whose CUDA
kernels are sources compiled on first import); it is taken from ``.whl/`` when the GPU
check's assets are there, else downloaded once into pytest's cache. No GPU is needed.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parents[4]
PIN = "1.6.5"
WHEEL_NAME = f"exllamav3-{PIN}-py3-none-any.whl"
SOURCES = (
    "engine_worker/exllamav3/*.py",
    "engine_worker/settings.py",
    "docs/exllamav3.md",
    "tests/fakes/exllamav3*.py",
    "scripts/gpu_check*.py",
    "tests/unit/engine_worker/exllamav3/*.py",
    "tests/unit/scripts/*.py",
    "tests/integration/test_exllamav3_through_proxy.py",
)
"""Where our ExLlamaV3 citations live (``../shared/reference`` is not ours)."""

_TOKEN = re.compile(
    r"(?P<path>[A-Za-z0-9_][A-Za-z0-9_/.]*\.py)"
    r":(?P<nums>\d+(?:-\d+)?(?:,[ \t]*(?:\n[ \t]*#[ \t]*)?\d+(?:-\d+)?)*)"
    r"|(?<![\w`])`{1,2}(?P<bare>\d+(?:-\d+)?)`{1,2}(?![\w`])"
    r"|(?P<para>\n[ \t]*\n|\n(?=\|))"
)
"""A citation, a bare backticked line number (the last citation's file), or the end of a
paragraph (a blank line, or a new Markdown table row) after which bare numbers cite nothing."""
_SYMBOL_BEFORE = re.compile(r"`{1,2}([A-Za-z_][\w.]*)(?:\([^`]*\))?`{1,2}[:,]?[ \t]*\(?[ \t]*`{0,2}$")
"""A backticked name right before the citation: ``_check_error`` (``llguidance.py:110-112``)."""


@dataclass(frozen=True)
class Citation:
    source: str
    line: int
    path: str
    first: int
    last: int
    symbol: str | None

    def __str__(self) -> str:
        rng = f"{self.first}" if self.first == self.last else f"{self.first}-{self.last}"
        return f"{self.source}:{self.line}: {self.path}:{rng}"


def find_citations(text: str, source: str) -> Iterator[Citation]:
    """The citations in ``text`` (the file ``source``), in order."""
    current: str | None = None
    for m in _TOKEN.finditer(text):
        if m["para"]:
            current = None
            continue
        if m["path"]:
            current = m["path"]
            numbers = re.findall(r"\d+(?:-\d+)?", m["nums"])
        elif current is not None:
            numbers = [m["bare"]]
        else:
            continue
        line_start = text.rfind("\n", 0, m.start()) + 1
        before = _SYMBOL_BEFORE.search(text[max(line_start, m.start() - 120) : m.start()])
        symbol = before[1].rsplit(".", 1)[-1] if before else None
        for n in numbers:
            first, _, last = n.partition("-")
            yield Citation(
                source, text.count("\n", 0, m.start()) + 1, current, int(first), int(last or first), symbol
            )


@dataclass
class Wheel:
    """The ``.py`` files of the wheel, by path inside it, and their top-level and nested
    definitions (name: ``(first line, last line)`` of each)."""

    files: dict[str, list[str]]
    defs: dict[str, dict[str, list[tuple[int, int]]]]

    @classmethod
    def read(cls, path: Path) -> Wheel:
        files: dict[str, list[str]] = {}
        defs: dict[str, dict[str, list[tuple[int, int]]]] = {}
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                if not name.endswith(".py"):
                    continue
                text = z.read(name).decode("utf-8")
                files[name] = text.splitlines()
                found: dict[str, list[tuple[int, int]]] = {}
                for node in ast.walk(ast.parse(text)):
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                        found.setdefault(node.name, []).append((node.lineno, node.end_lineno or node.lineno))
                defs[name] = found
        return cls(files, defs)

    def resolve(self, path: str) -> list[str]:
        path = path.lstrip("./")
        return [f for f in self.files if f == path or f.endswith("/" + path)]

    def problems(self, c: Citation) -> list[str]:
        found = self.resolve(c.path)
        if len(found) != 1:
            return [f"{c}: {c.path} is {'ambiguous' if found else 'not'} in the wheel {found or ''}".rstrip()]
        name = found[0]
        n = len(self.files[name])
        if not 1 <= c.first <= c.last <= n:
            return [f"{c}: {name} has {n} lines"]
        spans = self.defs[name].get(c.symbol or "")
        if spans and not any(a <= c.last and c.first <= b for a, b in spans):
            where = ", ".join(f"{a}-{b}" for a, b in spans)
            return [f"{c}: `{c.symbol}` is defined at {name}:{where}, not there"]
        return []


def _download(dest: Path) -> Path:
    wheel = dest / WHEEL_NAME
    if wheel.exists():
        return wheel
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        f"exllamav3=={PIN}",
        "--no-deps",
        "-q",
        "--dest",
        str(dest),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as e:
        _unavailable(f"cannot download exllamav3=={PIN}: {e}")
    if proc.returncode != 0 or not wheel.exists():
        got = sorted(p.name for p in dest.iterdir())
        if any(g.endswith((".tar.gz", ".zip")) for g in got):
            pytest.fail(f"pip fetched an sdist, not the {WHEEL_NAME} these tests read: {got}")
        _unavailable(f"cannot download exllamav3=={PIN} (offline?): {proc.stderr.strip()[-300:]}")
    return wheel


def _unavailable(why: str) -> NoReturn:
    """Skip where the wheel cannot be had (an offline machine); in CI (``CI`` set),
    which reaches the package index, fail: a broken download must not pass as a skip."""
    if os.environ.get("CI"):
        pytest.fail(f"{why} (CI is set: the citations must be checked there)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def wheel_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    carried = ROOT / ".whl" / WHEEL_NAME  # scripts/gpu_check_assets.py puts it there
    if carried.exists():
        return carried
    cache = getattr(request.config, "cache", None)
    dest = cache.mkdir(f"exllamav3-{PIN}") if cache is not None else tmp_path_factory.mktemp("wheel")
    return _download(Path(dest))


@pytest.fixture(scope="module")
def wheel(wheel_path: Path) -> Wheel:
    return Wheel.read(wheel_path)


def _our_citations() -> list[Citation]:
    out: list[Citation] = []
    for pattern in SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            if path.resolve() == Path(__file__).resolve():
                continue  # its examples are bad on purpose
            out += find_citations(path.read_text(), str(path.relative_to(ROOT)))
    return out


def test_the_pinned_wheel_is_pure_python_with_the_kernels_as_sources(wheel_path: Path) -> None:
    """What docs/exllamav3.md and the GPU check rely on: no prebuilt kernels in the wheel,
    so the first import compiles them (``ext.py``)."""
    with zipfile.ZipFile(wheel_path) as z:
        names = z.namelist()
        meta = z.read(f"exllamav3-{PIN}.dist-info/WHEEL").decode()
        version = z.read("exllamav3/version.py").decode()
    assert "Root-Is-Purelib: true" in meta and "Tag: py3-none-any" in meta
    assert f'__version__ = "{PIN}"' in version
    assert not [n for n in names if n.endswith((".so", ".pyd"))]
    cuda = [n for n in names if n.startswith("exllamav3/exllamav3_ext/") and n.endswith(".cu")]
    assert len(cuda) > 100


def test_every_exllamav3_citation_exists_in_the_pinned_wheel(wheel: Wheel) -> None:
    citations = _our_citations()
    # the parser found them all (about 450 in 1.6.5-era code), not a few
    assert len(citations) > 300
    assert {c.source.split("/")[0] for c in citations} >= {"engine_worker", "docs", "tests", "scripts"}
    assert (
        sum(c.symbol is not None and c.symbol in wheel.defs[wheel.resolve(c.path)[0]] for c in citations) > 5
    )
    problems = [p for c in citations for p in wheel.problems(c)]
    assert not problems, "\n".join(problems)


LLG = "exllamav3/generator/filter/llguidance.py"


def test_a_bad_citation_is_reported(wheel: Wheel) -> None:
    text = (
        "The mask (``generator/filter/llguidance.py:146-153``), ``_check_error`` (``110-112``).\n"
        "Past the end: ``generator/filter/llguidance.py:180-192``, and then ``170``.\n"
        "Wrong symbol: ``_check_error`` (``llguidance.py:146-153``); unknown: ``nowhere.py:3``.\n"
        "A comment list (tokenizer/tokenizer.py:830-832,\n    # 99999)\n"
        "\n"
        "A new paragraph: ``5`` cites nothing.\n"
    )
    cits = list(find_citations(text, "doc.md"))
    assert [(c.line, c.first, c.last, c.symbol) for c in cits] == [
        (1, 146, 153, None),
        (1, 110, 112, "_check_error"),
        (2, 180, 192, None),
        (2, 170, 170, None),
        (3, 146, 153, "_check_error"),
        (3, 3, 3, None),
        (4, 830, 832, None),
        (4, 99999, 99999, None),
    ]
    problems = [p for c in cits for p in wheel.problems(c)]
    assert problems == [
        f"doc.md:2: generator/filter/llguidance.py:180-192: {LLG} has 163 lines",
        f"doc.md:2: generator/filter/llguidance.py:170: {LLG} has 163 lines",
        f"doc.md:3: llguidance.py:146-153: `_check_error` is defined at {LLG}:110-112, not there",
        "doc.md:3: nowhere.py:3: nowhere.py is not in the wheel",
        "doc.md:4: tokenizer/tokenizer.py:99999: exllamav3/tokenizer/tokenizer.py has 931 lines",
    ]
