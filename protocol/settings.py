"""How both processes declare their options: one typed settings class each, the CLI derived from it.

The worker and the proxy are configured by the same operator, often in one pod
manifest, so their options follow one convention, kept here:

- A settings class is a frozen, keyword-only dataclass whose fields are declared
  with ``setting()``. Each option's name, type (the annotation), default, range,
  choices and help are written there once.
- ``click_options(cls)`` derives one click option per field: the flag is the field
  name in kebab case (``max_seq_len`` -> ``--max-seq-len``; booleans get
  ``--x/--no-x``), the environment variable is ``EXL3_SIDECAR_`` + the field name
  in upper case (``EXL3_SIDECAR_MAX_SEQ_LEN``), ranges become ``IntRange`` /
  ``FloatRange``, ``Literal`` and ``Enum`` annotations become ``Choice``. A field's
  ``aliases`` (the names llama.cpp and vLLM give the same setting: ``-c``,
  ``--ctx-size``, ``--max-model-len``) are more flags of the same option, listed
  beside it in ``--help``.
- ``HintedCommand`` is the click command class of a settings CLI: an unknown
  option that another server defines (``--gpu-memory-utilization``) is refused
  with the hint written for it (``hints``), naming this server's option if it
  has one; other unknown options keep click's "Did you mean" suggestions.
- ``check_ranges(obj)``, called from ``__post_init__``, enforces the same ranges
  and choices on objects built directly (tests, benchmarks): ``ValueError``
  naming the field.
- ``from_options(cls, values)`` builds the frozen object from click's values; a
  ``ValueError`` from the class's own cross-field checks becomes a
  ``click.UsageError`` (exit status 2, one line, no traceback).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click

ENV_PREFIX = "EXL3_SIDECAR_"
"""Every option's environment variable is this prefix plus the field name in upper case."""

_META_KEY = "exl3_sidecar_setting"


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    """What a settings field adds to its name, type and default: ``help`` (with the
    unit), an inclusive ``ge``/``le`` or exclusive ``gt`` bound, and whether the
    default is shown in ``--help`` (off for defaults computed per machine)."""

    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    show_default: bool = True
    aliases: tuple[str, ...] = ()
    """More flags for the option (``-c``, ``--ctx-size``): other servers' names of it."""


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    default_factory: Callable[[], Any] | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A settings field: ``x: int = setting(4, "What it is, unit.", ge=1)``; ``aliases``
    are more flags for it (``("-c", "--ctx-size")``), not for boolean fields."""
    spec = Spec(help, ge=ge, gt=gt, le=le, show_default=default_factory is None, aliases=aliases)
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={_META_KEY: spec})
    return dataclasses.field(default=default, metadata={_META_KEY: spec})


def env_var(name: str) -> str:
    """The environment variable of the field ``name``."""
    return ENV_PREFIX + name.upper()


def flag(name: str) -> str:
    """The command-line flag of the field ``name``."""
    return "--" + name.replace("_", "-")


@dataclasses.dataclass(frozen=True, slots=True)
class _Field:
    name: str
    spec: Spec
    base: Any  # the annotation without ``| None``
    optional: bool
    default: Any


def _fields(cls: type) -> list[_Field]:
    hints = typing.get_type_hints(cls)
    out: list[_Field] = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_META_KEY)
        if spec is None:
            continue
        ann = hints[f.name]
        args = typing.get_args(ann)
        optional = isinstance(ann, types.UnionType) and type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else ann
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append(_Field(f.name, spec, base, optional, default))
    return out


def _choices(base: Any) -> tuple[str, ...] | None:
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return tuple(str(m.value) for m in base)
    if typing.get_origin(base) is typing.Literal:
        return tuple(str(a) for a in typing.get_args(base))
    return None


def _click_type(f: _Field) -> Any:
    choices = _choices(f.base)
    if choices is not None:
        return click.Choice(choices)
    s = f.spec
    low = s.gt if s.gt is not None else s.ge
    if f.base is int and low is None and s.le is None:
        return click.INT
    if f.base is float and low is None and s.le is None:
        return click.FLOAT
    if f.base is int:
        return click.IntRange(
            min=None if low is None else int(low),
            max=None if s.le is None else int(s.le),
            min_open=s.gt is not None,
        )
    if f.base is float:
        return click.FloatRange(min=low, max=s.le, min_open=s.gt is not None)
    if f.base is Path:
        return click.Path(path_type=Path)
    return str


_Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def click_options(cls: type) -> _Decorator:
    """A decorator adding one ``click.Option`` per ``setting()`` field of ``cls``,
    in field order (see the module docstring for the naming)."""
    options: list[_Decorator] = []
    for f in _fields(cls):
        default = f.default.value if isinstance(f.default, enum.Enum) else f.default
        if f.base is bool:
            assert not f.spec.aliases, f"{f.name}: a boolean option takes no aliases"
            decls: tuple[str, ...] = (f"{flag(f.name)}/--no-{f.name.replace('_', '-')}",)
        else:
            decls = (flag(f.name), *f.spec.aliases)
        options.append(
            click.option(
                *decls,
                f.name,
                type=None if f.base is bool else _click_type(f),
                default=default,
                envvar=env_var(f.name),
                show_envvar=True,
                show_default=f.spec.show_default and default is not None,
                help=f.spec.help,
            )
        )

    def apply(func: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            func = option(func)
        return func

    return apply


class HintedCommand(click.Command):
    """A ``click.Command`` whose unknown options may carry a hint: ``hints`` maps a flag
    another server defines (``--gpu-memory-utilization``) to the sentence that says what
    to use here instead. Such a flag is a ``click.UsageError`` (exit status 2) with that
    sentence; any other unknown flag keeps click's own error and suggestions."""

    def __init__(self, *args: Any, hints: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hints: Mapping[str, str] = hints or {}

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.NoSuchOption as e:
            hint = self.hints.get(e.option_name)
            if hint is not None:
                raise click.UsageError(f"{e.option_name}: {hint}", ctx) from None
            if not e.possibilities:
                raise
            # An alias among click's suggestions is shown with the option it stands for.
            canonical = {o: p.opts[0] for p in self.params for o in p.opts}
            shown = [f"{o} (= {canonical[o]})" if canonical.get(o, o) != o else o for o in e.possibilities]
            raise click.UsageError(
                f"No such option {e.option_name!r}; did you mean {' or '.join(shown)}?", ctx
            ) from None


def check_ranges(obj: Any) -> None:
    """Raises ``ValueError`` naming the field when a ``setting()`` value is outside
    its range or choices. ``None`` passes for optional fields."""
    for f in _fields(type(obj)):
        value = getattr(obj, f.name)
        if value is None:
            if not f.optional:
                raise ValueError(f"{f.name}: a value is required")
            continue
        choices = _choices(f.base)
        if choices is not None and str(getattr(value, "value", value)) not in choices:
            raise ValueError(f"{f.name}={value!r}: expected one of {', '.join(choices)}")
        s = f.spec
        if s.ge is not None and value < s.ge:
            raise ValueError(f"{f.name}={value!r}: must be >= {s.ge:g}")
        if s.gt is not None and value <= s.gt:
            raise ValueError(f"{f.name}={value!r}: must be > {s.gt:g}")
        if s.le is not None and value > s.le:
            raise ValueError(f"{f.name}={value!r}: must be <= {s.le:g}")


_S = TypeVar("_S")


def from_options(cls: type[_S], values: Mapping[str, Any]) -> _S:
    """``cls`` built from click's parsed values (extra keys ignored, enum fields
    converted). Raises ``click.UsageError`` carrying the class's ``ValueError``."""
    kw: dict[str, Any] = {}
    for f in _fields(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        if value is None and not f.optional:
            continue  # a computed default (default_factory): the class fills it in
        if value is not None and isinstance(f.base, type) and issubclass(f.base, enum.Enum):
            value = f.base(value)
        kw[f.name] = value
    try:
        return cls(**kw)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def cli_args(obj: Any, names: tuple[str, ...]) -> list[str]:
    """The command line that sets the fields ``names`` of ``obj`` to their values
    (``None`` values are left out): how ``serve`` hands options to its worker."""
    out: list[str] = []
    for name in names:
        value = getattr(obj, name)
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(flag(name) if value else f"--no-{name.replace('_', '-')}")
        else:
            out += [flag(name), str(getattr(value, "value", value))]
    return out
