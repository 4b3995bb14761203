"""The local-LLM sampler vocabulary: one table of every sampler field this
server knows, its aliases, its neutral value and what each engine does with it.

The table (``TABLE``) is the single source of three things:

- the request rule (``resolve``, run by ``proxy.core.fields.decode`` on every
  body decoded into a ``proxy.core.fields.SamplerFields`` struct, so chat, text
  completions, Responses and Messages alike): an alias becomes the field's own
  name (two spellings with different values are a 400 naming both), a field
  no engine can honour is accepted at its neutral value and refused with a
  400 naming it at any other, and TabbyAPI's/SillyTavern's loose shapes become
  this server's (a comma-separated ``banned_tokens`` string, one
  ``banned_strings`` string, ``seed: -1`` for "random");
- the sampler table in ``docs/http-contract.md`` (``markdown_table``; a test
  keeps the two equal);
- the tests of every field (``tests/unit/proxy/core/test_samplers.py`` walks the table).

Sources of names and neutral values: TabbyAPI's ``common/sampling.py``
(``BaseSamplerRequest``, its ``AliasChoices`` and ``UNSUPPORTED_PARAMS``),
SillyTavern's ``public/scripts/textgen-settings.js`` (``getTextGenGenerationData``
and its default ``settings``), llama.cpp's server (``repeat_penalty``, ``tfs_z``,
``mirostat``). Semantics of the honoured fields are ExLlamaV3 1.6.5's
(``engine_worker.exllamav3.sampling`` cites its source); the CPU engine
implements the same steps (``engine_worker.cpu.sampling``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec

from proxy.errors import InvalidRequest


class Support(enum.StrEnum):
    """What an engine does with a field."""

    HONOURED = "honoured"
    NEUTRAL = "neutral only"  # accepted at the neutral value, refused at any other
    ACCEPTED = "accepted"  # any value: it changes nothing about the output (the table says why)


Raw = Mapping[str, object]
"""The request body's top-level fields (``null`` ones already dropped)."""


@dataclass(frozen=True, slots=True)
class SamplerField:
    """One row: ``name`` (the field of ``SamplerFields`` for an honoured one),
    ``aliases`` (other spellings, same meaning), ``neutral`` (the value that
    asks for nothing, as the docs write it), per-engine ``cpu``/``exllamav3``
    support, ``origin`` (who defines it) and ``meaning`` (one sentence).
    ``is_neutral(value, raw)`` tells whether a value asks for nothing; ``raw``
    is the whole body, for a parameter of a step another field switches off
    (``dry_base`` while ``dry_multiplier`` is 0)."""

    name: str
    aliases: tuple[str, ...]
    neutral: str
    cpu: Support
    exllamav3: Support
    origin: str
    meaning: str
    is_neutral: Callable[[object, Raw], bool]

    @property
    def honoured_somewhere(self) -> bool:
        """Some engine takes any value: the proxy passes it on, and a worker whose
        engine has not the step refuses it (``engine_worker.admission``)."""
        return self.cpu is not Support.NEUTRAL or self.exllamav3 is not Support.NEUTRAL


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _equals(target: float) -> Callable[[object, Raw], bool]:
    return lambda v, raw: _number(v) and float(v) == target  # type: ignore[arg-type]


def _is(target: object) -> Callable[[object, Raw], bool]:
    return lambda v, raw: type(v) is type(target) and v == target


def _empty(v: object, raw: Raw) -> bool:
    return v in ("", [], {})


def _any(v: object, raw: Raw) -> bool:
    return True


def _off_unless(switch: str, off: Callable[[object, Raw], bool]) -> Callable[[object, Raw], bool]:
    """A step's parameter: any value while the step's switch (``switch``) is absent or off."""

    def check(v: object, raw: Raw) -> bool:
        return switch not in raw or off(raw[switch], raw)

    return check


def _dynatemp_off(v: object, raw: Raw) -> bool:
    """Dynamic temperature is on when asked (``dynamic_temperature: true``), or
    (TabbyAPI's rule) when ``min_temp`` and ``max_temp`` are both given and differ,
    or with a non-zero ``dynatemp_range``."""
    if raw.get("dynamic_temperature") is True:
        return False
    low, high = raw.get("min_temp"), raw.get("max_temp")
    if low is not None and high is not None and low != high:
        return False
    rng = raw.get("dynatemp_range")
    return rng is None or (_number(rng) and float(rng) == 0.0)  # type: ignore[arg-type]


_H, _N, _A = Support.HONOURED, Support.NEUTRAL, Support.ACCEPTED
_TABBY = "TabbyAPI"
_ST = "SillyTavern"

TABLE: tuple[SamplerField, ...] = (
    # ------------------------------------------------ honoured on both engines
    SamplerField("temperature", (), "1", _H, _H, "OpenAI", "Divides the logits; 0 is greedy.", _any),
    SamplerField(
        "temperature_last",
        (),
        "false",
        _H,
        _H,
        _TABBY,
        "Applies the temperature after top-k/top-p/min-p instead of before.",
        _any,
    ),
    SamplerField("top_p", (), "1", _H, _H, "OpenAI", "Nucleus: the smallest set reaching this mass.", _any),
    SamplerField("top_k", (), "0 (or -1)", _H, _H, "vLLM", "Keeps the k most likely tokens.", _any),
    SamplerField(
        "min_p", (), "0", _H, _H, "vLLM", "Drops tokens below min_p times the top probability.", _any
    ),
    SamplerField(
        "repetition_penalty",
        ("rep_pen", "repeat_penalty"),
        "1",
        _H,
        _H,
        "vLLM",
        "Divides positive (multiplies negative) logits of tokens already in the context.",
        _any,
    ),
    SamplerField(
        "penalty_range",
        ("repetition_range", "repetition_penalty_range", "rep_pen_range"),
        "-1 (the whole context)",
        _H,
        _H,
        _TABBY,
        "Most recent tokens the penalties apply to in full (ExLlamaV3's sustain range); 0, no decay: none.",
        _any,
    ),
    SamplerField(
        "repetition_decay",
        (),
        "0",
        _H,
        _H,
        _TABBY,
        "Tokens beyond penalty_range over which the penalties fade linearly to nothing.",
        _any,
    ),
    SamplerField(
        "presence_penalty", (), "0", _H, _H, "OpenAI", "Subtracted once from a token already seen.", _any
    ),
    SamplerField(
        "frequency_penalty",
        (),
        "0",
        _H,
        _H,
        "OpenAI",
        "Subtracted per occurrence of a token already seen.",
        _any,
    ),
    SamplerField(
        "xtc_probability",
        (),
        "0",
        _H,
        _H,
        _TABBY,
        "Exclude Top Choices: with this probability, every token at or above xtc_threshold but the least "
        "likely one is excluded (newline and special tokens are never excluded).",
        _any,
    ),
    SamplerField(
        "xtc_threshold",
        (),
        "0.1",
        _H,
        _H,
        _TABBY,
        "The probability a token needs to be excluded by XTC.",
        _any,
    ),
    SamplerField(
        "banned_tokens",
        ("custom_token_bans",),
        '[] (or "")',
        _H,
        _H,
        _TABBY,
        "Token ids never sampled (a list, or SillyTavern's comma-separated string).",
        _any,
    ),
    SamplerField(
        "ban_eos_token",
        (),
        "false",
        _H,
        _H,
        _TABBY,
        "The model's end-of-sequence tokens are never sampled (and do not stop the answer).",
        _any,
    ),
    SamplerField(
        "ignore_eos", (), "false", _H, _H, "vLLM", "End-of-sequence tokens do not end the answer.", _any
    ),
    SamplerField(
        "min_tokens",
        ("min_length",),
        "0",
        _H,
        _H,
        "vLLM",
        "End-of-sequence and stop tokens are masked until this many tokens are out.",
        _any,
    ),
    SamplerField(
        "logit_bias", (), "{}", _H, _H, "OpenAI", "Added to the logits of the given token ids.", _any
    ),
    SamplerField("stop_token_ids", (), "[]", _H, _H, "vLLM", "Token ids that end the answer.", _any),
    SamplerField(
        "seed",
        (),
        "absent (or -1: random)",
        _H,
        _H,
        "OpenAI",
        "Seeds the sequence's generator; -1 means a random seed, as in TabbyAPI and llama.cpp.",
        _any,
    ),
    SamplerField(
        "skip_special_tokens",
        (),
        "absent (the engine's default: CPU skips, ExLlamaV3 keeps)",
        _H,
        _H,
        "vLLM",
        "Leaves special tokens (other than stop tokens, which never show) out of the text.",
        _any,
    ),
    SamplerField(
        "add_bos_token",
        (),
        "absent (the model's own choice)",
        _H,
        _H,
        _TABBY,
        "Whether a raw prompt starts with the BOS token; with messages the chat template places it "
        "(any value is refused there).",
        _any,
    ),
    # ------------------------------------ accepted: they change nothing about the output
    SamplerField(
        "speculative_ngram",
        (),
        "false",
        _A,
        _A,
        _TABBY,
        "Drafting is the worker's setting (--ngram); drafts never change the output, only its speed.",
        _any,
    ),
    # ------------------------------------ neither engine has the step: neutral only
    SamplerField(
        "banned_strings",
        (),
        '[] (or "")',
        _H,
        _H,
        _TABBY,
        "Strings never written (case-insensitive): held back, and the sequence rewound where one began, "
        "as ExLlamaV3's Job does. On CPU not with response_format or logprobs.",
        _empty,
    ),
    SamplerField(
        "dry_multiplier",
        (),
        "0",
        _H,
        _H,
        _TABBY,
        "DRY: a token extending a repeat of n >= dry_allowed_length tokens loses "
        "dry_multiplier * dry_base ** (n - dry_allowed_length) (ExLlamaV3's SS_DRY).",
        _any,
    ),
    SamplerField(
        "dry_base", (), "1.75", _H, _H, _TABBY, "DRY's growth per repeated token; below 1: off.", _any
    ),
    SamplerField("dry_allowed_length", (), "2", _H, _H, _TABBY, "The longest repeat DRY leaves alone.", _any),
    SamplerField(
        "dry_range",
        ("dry_penalty_last_n",),
        "0 (the whole context)",
        _H,
        _H,
        _TABBY,
        "The most recent tokens DRY looks at.",
        _any,
    ),
    SamplerField(
        "dry_sequence_breakers",
        (),
        "absent (ExLlamaV3's set: .,!?<>[](){} newline tab quote, special tokens)",
        _H,
        _H,
        _TABBY,
        "Strings a repeat cannot span: every token whose text contains one (a list, or its JSON text).",
        _any,
    ),
    SamplerField(
        "mirostat_mode",
        ("mirostat",),
        "0",
        _N,
        _N,
        _TABBY,
        "Mirostat sampling (ExLlamaV3 has none).",
        _equals(0.0),
    ),
    *(
        SamplerField(
            name,
            (),
            "any, while mirostat_mode is 0",
            _N,
            _N,
            _TABBY,
            "A Mirostat parameter.",
            _off_unless("mirostat_mode", _equals(0.0)),
        )
        for name in ("mirostat_tau", "mirostat_eta")
    ),
    SamplerField(
        "typical",
        ("typical_p",),
        "1",
        _N,
        _N,
        _TABBY,
        "Locally typical sampling (ExLlamaV3 has none).",
        _equals(1.0),
    ),
    SamplerField(
        "tfs", ("tfs_z",), "1", _N, _N, _TABBY, "Tail-free sampling (ExLlamaV3 has none).", _equals(1.0)
    ),
    SamplerField("top_a", (), "0", _N, _N, _TABBY, "Top-a (ExLlamaV3 has none).", _equals(0.0)),
    SamplerField("skew", (), "0", _N, _N, _TABBY, "Skew (ExLlamaV3 has none).", _equals(0.0)),
    SamplerField(
        "smoothing_factor", (), "0", _N, _N, _TABBY, "Quadratic smoothing (ExLlamaV3 has none).", _equals(0.0)
    ),
    SamplerField(
        "smoothing_curve",
        (),
        "any, while smoothing_factor is 0",
        _N,
        _N,
        _ST,
        "A smoothing parameter.",
        _off_unless("smoothing_factor", _equals(0.0)),
    ),
    SamplerField(
        "dynamic_temperature",
        (),
        "false",
        _N,
        _N,
        _ST,
        "Dynamic temperature (ExLlamaV3 has none).",
        _dynatemp_off,
    ),
    *(
        SamplerField(
            name,
            aliases,
            "equal bounds, or either absent" if name in ("min_temp", "max_temp") else "any, while off",
            _N,
            _N,
            _TABBY,
            "A dynamic temperature parameter.",
            _dynatemp_off,
        )
        for name, aliases in (
            ("min_temp", ("dynatemp_low",)),
            ("max_temp", ("dynatemp_high",)),
            ("temp_exponent", ("dynatemp_exponent",)),
            ("dynatemp_range", ()),
        )
    ),
    SamplerField(
        "adaptive_target",
        (),
        "1",
        _N,
        _N,
        _TABBY,
        "Adaptive-P. ExLlamaV3 has SS_AdaptiveP; the CPU engine has not, so neither takes it yet.",
        _equals(1.0),
    ),
    SamplerField(
        "adaptive_decay",
        (),
        "any, while adaptive_target is 1",
        _N,
        _N,
        _TABBY,
        "An Adaptive-P parameter.",
        _off_unless("adaptive_target", _equals(1.0)),
    ),
    SamplerField(
        "token_healing", (), "false", _N, _N, _TABBY, "Token healing of the prompt's last token.", _is(False)
    ),
    SamplerField(
        "allowed_tokens",
        ("allowed_token_ids",),
        '[] (or "")',
        _N,
        _N,
        _TABBY,
        "Only these token ids may be sampled.",
        _empty,
    ),
    SamplerField(
        "loop_detect_window",
        (),
        "0",
        _N,
        _N,
        _TABBY,
        "Stops the answer on a repeating pattern.",
        _equals(0.0),
    ),
    SamplerField(
        "grammar_string",
        ("grammar",),
        '""',
        _N,
        _N,
        _TABBY,
        "A Lark/GBNF grammar; use response_format (JSON schemas) instead.",
        _empty,
    ),
    SamplerField(
        "json_schema",
        (),
        "{} (or absent)",
        _N,
        _N,
        _TABBY,
        "TabbyAPI's and llama.cpp's JSON schema field; use response_format (honoured) instead.",
        _empty,
    ),
    SamplerField(
        "regex_pattern", (), '""', _N, _N, _TABBY, "A regular expression the answer must match.", _empty
    ),
    SamplerField(
        "negative_prompt", (), '""', _N, _N, _ST, "Classifier-free guidance's negative prompt.", _empty
    ),
    SamplerField("guidance_scale", (), "1", _N, _N, _ST, "Classifier-free guidance's scale.", _equals(1.0)),
    SamplerField("rep_pen_slope", (), "1", _N, _N, _ST, "KoboldCpp's penalty slope.", _equals(1.0)),
    SamplerField(
        "max_tokens_second", (), "0", _N, _N, _ST, "Throttles the stream to this rate.", _equals(0.0)
    ),
)

BY_NAME: dict[str, SamplerField] = {row.name: row for row in TABLE}
ALIASES: dict[str, str] = {alias: row.name for row in TABLE for alias in row.aliases}
"""Alias -> the field's own name."""


def resolve(raw: dict[str, object], where: str) -> dict[str, object]:
    """``raw`` (a body's top-level fields, ``null`` ones dropped) in the
    table's terms: aliases renamed, loose shapes made strict, and a field that
    no engine can honour refused unless neutral (one that one engine lacks is
    the worker's to refuse: ``ModelInfo.banned_strings``). Raises ``InvalidRequest``
    naming the field (the alias the client wrote, when it wrote one); ``where``
    is the endpoint, for the message."""
    out = dict(raw)
    for alias, name in ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if name in out and out[name] != value:
            raise InvalidRequest(
                f"'{alias}' and '{name}' are two names of one field and were given different values",
                param=alias,
            )
        out[name] = value
    written = {name: alias for alias, name in ALIASES.items() if alias in raw and name not in raw}
    for name, value in list(out.items()):
        row = BY_NAME.get(name)
        if row is None or row.honoured_somewhere or row.is_neutral(value, out):
            continue
        param = written.get(name, name)
        raise InvalidRequest(
            f"'{param}' = {value!r} is not supported by this server on {where}: {row.meaning} Only its "
            f"neutral value ({row.neutral}) is accepted; any other is refused rather than ignored so that "
            "the answer never silently differs from what was asked",
            param=param,
        )
    tokens = out.get("banned_tokens")
    if isinstance(tokens, str):
        # SillyTavern's and TabbyAPI's text form: "1, 2,3"; anything else in it is an error, not skipped.
        parts = [p.strip() for p in tokens.split(",") if p.strip()]
        if not all(p.isascii() and p.isdigit() for p in parts):
            param = written.get("banned_tokens", "banned_tokens")
            raise InvalidRequest(
                f"'{param}' as a string must be comma-separated token ids, got {tokens!r}", param=param
            )
        out["banned_tokens"] = [int(p) for p in parts]
    breakers = out.get("dry_sequence_breakers")
    if isinstance(breakers, str):
        # TabbyAPI's and SillyTavern's text form: a JSON array, or its items without the brackets.
        text = breakers if breakers.startswith("[") else f"[{breakers}]"
        try:
            out["dry_sequence_breakers"] = msgspec.json.decode(text)
        except msgspec.DecodeError:
            raise InvalidRequest(
                f"'dry_sequence_breakers' as a string must be a JSON array of strings, got {breakers!r}",
                param="dry_sequence_breakers",
            ) from None
    strings = out.get("banned_strings")
    if isinstance(strings, str):
        out["banned_strings"] = [strings] if strings else []
    if out.get("seed") == -1:
        del out["seed"]  # TabbyAPI's, SillyTavern's and llama.cpp's "random seed"
    return out


def _cell(support: Support) -> str:
    return {Support.HONOURED: "yes", Support.NEUTRAL: "neutral only", Support.ACCEPTED: "accepted"}[support]


def markdown_table() -> str:
    """The table as ``docs/http-contract.md`` has it (Markdown, one row per
    field, ending with a newline)."""
    lines = [
        "| Field | Aliases | Neutral value | CPU | ExLlamaV3 | From | What it does |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in TABLE:
        aliases = ", ".join(f"`{a}`" for a in row.aliases) or "-"
        lines.append(
            f"| `{row.name}` | {aliases} | {row.neutral} | {_cell(row.cpu)} | {_cell(row.exllamav3)} "
            f"| {row.origin} | {row.meaning} |"
        )
    return "\n".join(lines) + "\n"
