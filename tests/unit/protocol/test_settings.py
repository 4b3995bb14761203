"""The option convention both processes share: CLI derived from a typed settings class."""

from __future__ import annotations

import dataclasses
import enum
import os
from pathlib import Path
from typing import Any, Literal

import click
import pytest
from click.testing import CliRunner

from protocol.settings import (
    HintedCommand,
    check_ranges,
    cli_args,
    click_options,
    env_var,
    flag,
    from_options,
    setting,
)


class Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Example:
    count: int = setting(4, "A count, tokens.", ge=1, le=10)
    ratio: float = setting(0.5, "A ratio.", gt=0)
    name: str | None = setting(None, "A name.")
    mode: Literal["a", "b"] = setting("a", "A mode.")
    colour: Colour = setting(Colour.RED, "A colour.")
    on: bool = setting(True, "A switch.")
    where: Path = setting(default_factory=lambda: Path("/computed"), help="A path.")
    internal: int = 7  # no setting(): not an option

    def __post_init__(self) -> None:
        check_ranges(self)


@click.command()
@click_options(Example)
def cmd(**values: Any) -> None:
    click.echo(repr(from_options(Example, values)))


def _parse(*args: str) -> Example:
    return from_options(Example, cmd.make_context("cmd", list(args)).params)


def run(*args: str, env: dict[str, str] | None = None) -> click.testing.Result:
    return CliRunner().invoke(cmd, list(args), env=env)


def test_names_are_derived_from_the_field() -> None:
    assert flag("max_seq_len") == "--max-seq-len" and env_var("max_seq_len") == "EXL3_SIDECAR_MAX_SEQ_LEN"


def test_defaults_come_from_the_class() -> None:
    assert _parse() == Example()
    assert _parse().where == Path("/computed")


def test_flags_and_env_vars_set_values_and_flags_win() -> None:
    got = _parse(
        "--count", "9", "--ratio", "2.5", "--name", "x", "--mode", "b", "--colour", "blue", "--no-on"
    )
    assert got == Example(count=9, ratio=2.5, name="x", mode="b", colour=Colour.BLUE, on=False)
    r = run(env={"EXL3_SIDECAR_COUNT": "3", "EXL3_SIDECAR_ON": "0", "EXL3_SIDECAR_COLOUR": "blue"})
    assert r.exit_code == 0 and "count=3" in r.output and "on=False" in r.output
    assert "<Colour.BLUE: 'blue'>" in r.output
    r = run("--count", "5", env={"EXL3_SIDECAR_COUNT": "3"})
    assert "count=5" in r.output


@pytest.mark.parametrize(
    ("args", "env", "names"),
    [
        (["--count", "0"], None, "--count"),
        (["--count", "11"], None, "--count"),
        (["--ratio", "0"], None, "--ratio"),
        (["--mode", "c"], None, "--mode"),
        ([], {"EXL3_SIDECAR_COUNT": "many"}, "EXL3_SIDECAR_COUNT"),
    ],
)
def test_bad_values_are_usage_errors_naming_the_option(
    args: list[str], env: dict[str, str] | None, names: str
) -> None:
    r = run(*args, env=env)
    assert r.exit_code == 2 and names in r.output and "Traceback" not in r.output


def test_internal_fields_are_not_options() -> None:
    assert "--internal" not in run("--help").output


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"count": 0}, "count"),
        ({"ratio": 0.0}, "ratio"),
        ({"mode": "z"}, "mode"),
        ({"colour": "green"}, "colour"),
    ],
)
def test_direct_construction_checks_the_same_ranges(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Example(**kw)


def test_cli_args_round_trip() -> None:
    e = Example(count=2, name="n", colour=Colour.BLUE, on=False)
    names = ("count", "name", "colour", "on", "mode")
    assert _parse(*cli_args(e, names)) == dataclasses.replace(
        Example(), count=2, name="n", colour=Colour.BLUE, on=False
    )
    assert cli_args(Example(), ("name",)) == []


@pytest.mark.parametrize(
    ("addr", "ok"),
    [
        ("ipc:///run/x/input.sock", True),
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.1.2.3:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.0.0.7:5555", False),
        ("tcp://worker.example:5555", False),
    ],
)
def test_the_worker_link_stays_on_the_machine(addr: str, ok: bool) -> None:
    from protocol.endpoints import LinkSettings

    if ok:
        assert LinkSettings(input_addr=addr).input_addr == addr
    else:
        with pytest.raises(ValueError, match=r"input_addr=.*must stay"):
            LinkSettings(input_addr=addr)


def test_json_logs_turn_progress_bars_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    from protocol.logs import JsonFormatter, setup_logging

    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        setup_logging("info", "json")
        assert os.environ["TQDM_DISABLE"] == "1"
        assert isinstance(root.handlers[0].formatter, JsonFormatter)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


@dataclasses.dataclass(frozen=True, kw_only=True)
class WithAliases:
    size: int = setting(8, "A size, tokens.", ge=1, aliases=("-s", "--ctx-size"))


@click.command(cls=HintedCommand, hints={"--gpu-fraction": "use --size (tokens) instead"})
@click_options(WithAliases)
def aliased(**values: Any) -> None:
    click.echo(repr(from_options(WithAliases, values)))


def test_aliases_set_the_same_field_and_share_its_checks() -> None:
    for args in (["--size", "3"], ["-s", "3"], ["--ctx-size", "3"]):
        r = CliRunner().invoke(aliased, args)
        assert r.exit_code == 0 and r.output.strip() == "WithAliases(size=3)", args
    r = CliRunner().invoke(aliased, ["--ctx-size", "0"])
    assert r.exit_code == 2 and "--ctx-size" in r.output  # the range, named as typed


def test_a_hinted_foreign_flag_is_a_usage_error_with_its_hint() -> None:
    r = CliRunner().invoke(aliased, ["--gpu-fraction", "0.9"])
    assert r.exit_code == 2 and "--gpu-fraction: use --size (tokens) instead" in r.output
    r = CliRunner().invoke(aliased, ["--ctx-sise", "3"])
    assert r.exit_code == 2 and "did you mean --ctx-size (= --size)" in r.output


def test_a_boolean_option_takes_no_aliases() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Bad:
        on: bool = setting(True, "A switch.", aliases=("-o",))

    with pytest.raises(AssertionError, match="no aliases"):
        click_options(Bad)
