"""Each package's ``__init__.py`` docstring is its index (issue 39): a Markdown table
``| module | what |`` with one row per module and subpackage of the folder, the name
double-backticked in the first column (``proxy/core/__init__.py`` is the model). The
index must name exactly what the folder holds: every ``*.py`` but ``__init__.py``
(``__main__`` included), and every subfolder with an ``__init__.py``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("protocol", "proxy", "engine_worker", "launcher")
HEADER = re.compile(r"^\|\s*module\s*\|\s*what\s*\|\s*$")
RULE = re.compile(r"^\|\s*:?-{3,}:?\s*\|\s*:?-{3,}:?\s*\|\s*$")
ROW = re.compile(r"^\|\s*``([A-Za-z_][A-Za-z0-9_]*)/?``\s*\|(.+)\|\s*$")


def _packages() -> list[Path]:
    found = []
    for root in ROOTS:
        inits = (REPO / root).rglob("__init__.py")
        found += [init.parent for init in inits if "__pycache__" not in init.parts]
    return sorted(found)


def _contents(package: Path) -> set[str]:
    modules = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
    subpackages = {p.parent.name for p in package.glob("*/__init__.py")}
    return modules | subpackages


def _indexed(package: Path) -> tuple[set[str], list[str]]:
    """The names the docstring's table lists, and what is wrong with the table."""
    rel = package.relative_to(REPO)
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()), clean=True) or ""
    lines = doc.splitlines()
    starts = [i for i, line in enumerate(lines) if HEADER.match(line.strip())]
    if not starts:
        return set(), [f"{rel}/__init__.py: no `| module | what |` table in its docstring"]
    if len(starts) > 1:
        return set(), [f"{rel}/__init__.py: {len(starts)} index tables; one is the index"]
    start = starts[0]
    problems = []
    if start + 1 >= len(lines) or not RULE.match(lines[start + 1].strip()):
        problems.append(f"{rel}/__init__.py: the table's header is not followed by `|---|---|`")
    names: list[str] = []
    for line in lines[start + 2 :]:
        line = line.strip()
        if not line.startswith("|"):
            break
        row = ROW.match(line)
        if not row:
            problems.append(f"{rel}/__init__.py: a row does not name one ``module``: {line!r}")
            continue
        if not row.group(2).strip():
            problems.append(f"{rel}/__init__.py: ``{row.group(1)}`` has no description")
        names.append(row.group(1))
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"{rel}/__init__.py: listed twice: {', '.join(dupes)}")
    return set(names), problems


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(REPO)))
def test_the_package_index_names_exactly_its_modules(package: Path) -> None:
    rel = package.relative_to(REPO)
    have = _contents(package)
    if not have:
        return  # a package with no modules needs no table
    listed, problems = _indexed(package)
    missing = sorted(have - listed)
    extra = sorted(listed - have)
    if missing:
        problems.append(f"{rel}/__init__.py: the index omits {', '.join(missing)}")
    if extra:
        problems.append(f"{rel}/__init__.py: the index names {', '.join(extra)}, not in {rel}/")
    assert not problems, "\n".join(problems)
