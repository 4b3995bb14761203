"""The local-LLM sampler vocabulary (``proxy.core.samplers.TABLE``) on every
dialect: each honoured field reaches the worker, each field neither engine
has is accepted at its neutral value and refused with a 400 naming it at any
other, aliases mean their field, SillyTavern's neutral TabbyAPI body asks for
exactly what a plain request asks for, and the docs' table is the table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from proxy.core.samplers import TABLE, Support, markdown_table
from tests.fakes.engine_client import FakeEngineClient, static_script
from tests.unit.proxy.conftest import MakeClient

ROOT = Path(__file__).resolve().parents[4]

BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
}

# A value that asks for something, per neutral-only field (its step switched on where it has a switch).
ACTIVE: dict[str, tuple[object, dict[str, object]]] = {
    "mirostat_mode": (2, {}),
    "mirostat_tau": (3.0, {"mirostat_mode": 2}),
    "mirostat_eta": (0.2, {"mirostat_mode": 2}),
    "typical": (0.5, {}),
    "tfs": (0.5, {}),
    "top_a": (0.2, {}),
    "skew": (0.5, {}),
    "smoothing_factor": (0.3, {}),
    "smoothing_curve": (2.0, {"smoothing_factor": 0.3}),
    "dynamic_temperature": (True, {}),
    "min_temp": (0.5, {"max_temp": 1.5}),
    "max_temp": (1.5, {"min_temp": 0.5}),
    "temp_exponent": (2.0, {"dynamic_temperature": True}),
    "dynatemp_range": (0.5, {}),
    "adaptive_target": (0.5, {}),
    "adaptive_decay": (0.5, {"adaptive_target": 0.5}),
    "token_healing": (True, {}),
    "allowed_tokens": ([1, 2], {}),
    "loop_detect_window": (800, {}),
    "grammar_string": ('root ::= "a"', {}),
    "json_schema": ({"type": "object"}, {}),
    "regex_pattern": ("a+", {}),
    "negative_prompt": ("bad", {}),
    "guidance_scale": (1.5, {}),
    "rep_pen_slope": (0.5, {}),
    "max_tokens_second": (10, {}),
}

# SillyTavern's neutral values for these (textgen-settings.js, its default `settings`).
NEUTRAL: dict[str, object] = {
    "mirostat_mode": 0,
    "mirostat_tau": 5,
    "mirostat_eta": 0.1,
    "typical": 1,
    "tfs": 1,
    "top_a": 0,
    "skew": 0,
    "smoothing_factor": 0.0,
    "smoothing_curve": 1.0,
    "dynamic_temperature": False,
    "min_temp": 1.0,
    "max_temp": 1.0,
    "temp_exponent": 1.0,
    "dynatemp_range": 0,
    "adaptive_target": 1.0,
    "adaptive_decay": 0.9,
    "token_healing": False,
    "allowed_tokens": [],
    "loop_detect_window": 0,
    "grammar_string": "",
    "json_schema": {},
    "regex_pattern": "",
    "negative_prompt": "",
    "guidance_scale": 1,
    "rep_pen_slope": 1,
    "max_tokens_second": 0,
}

NEUTRAL_ONLY = [row.name for row in TABLE if row.cpu is Support.NEUTRAL and row.exllamav3 is Support.NEUTRAL]
"""The fields the proxy refuses unless neutral; one that a single engine lacks is the worker's to refuse."""


def test_every_neutral_only_field_has_a_case() -> None:
    assert sorted(NEUTRAL_ONLY) == sorted(ACTIVE) == sorted(NEUTRAL)


def test_the_docs_table_is_the_table() -> None:
    doc = (ROOT / "docs/http-contract.md").read_text()
    assert markdown_table() in doc


async def _post(make_client: MakeClient, path: str, extra: dict[str, object]) -> tuple[int, Any]:
    client = await make_client()
    r = await client.post(path, json={**BODIES[path], **extra})
    return r.status, await r.json()


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("name", NEUTRAL_ONLY)
async def test_neutral_only_fields_are_refused_when_active(
    make_client: MakeClient, fake: FakeEngineClient, path: str, name: str
) -> None:
    fake.script = static_script(["ok"])
    value, switches = ACTIVE[name]
    status, body = await _post(make_client, path, {**switches, name: value})
    assert status == 400, body
    # The field is named (or, for a step's parameter, the switch that turned the step on).
    assert any(f"'{n}'" in body["error"]["message"] for n in (name, *switches)), body
    if "param" in body["error"]:
        assert body["error"]["param"] in (name, *switches)
    status, body = await _post(make_client, path, {name: NEUTRAL[name]})
    assert status == 200, body
    if switches and name not in ("min_temp", "max_temp"):
        # A step's parameter with the step off asks for nothing: accepted at any value.
        status, body = await _post(make_client, path, {name: value})
        assert status == 200, body


@pytest.mark.parametrize("path", list(BODIES))
async def test_honoured_fields_reach_the_worker(
    make_client: MakeClient, fake: FakeEngineClient, path: str
) -> None:
    fake.script = static_script(["ok"])
    extra = {
        "temperature_last": True,
        "rep_pen_range": 64,
        "repetition_decay": 16,
        "xtc_probability": 0.5,
        "xtc_threshold": 0.2,
        "custom_token_bans": "5, 7,5",
        "ban_eos_token": True,
        "skip_special_tokens": True,
        "rep_pen": 1.1,
        "min_length": 2,
        "seed": -1,
        "banned_strings": "Paris",
        "dry_multiplier": 0.8,
        "dry_penalty_last_n": 64,
        "dry_sequence_breakers": '"\\n", ":"',
    }
    status, body = await _post(make_client, path, extra)
    assert status == 200, body
    p = fake.submits[-1].params
    assert (p.temperature_last, p.penalty_range, p.repetition_decay) == (True, 64, 16)
    assert (p.xtc_probability, p.xtc_threshold, p.banned_tokens) == (0.5, 0.2, (5, 7))
    assert (p.ban_eos_token, p.skip_special_tokens, p.repetition_penalty, p.min_tokens) == (
        True,
        True,
        1.1,
        2,
    )
    assert p.seed is None  # -1: a random seed
    assert p.banned_strings == ("Paris",)  # one string: a list of it
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_range) == (0.8, 1.75, 2, 64)
    assert p.dry_sequence_breakers == ("\n", ":")  # TabbyAPI's bracketless JSON text


async def test_aliases_with_different_values_are_refused(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    status, body = await _post(make_client, "/v1/completions", {"rep_pen": 1.1, "repetition_penalty": 1.2})
    assert status == 400 and body["error"]["param"] == "rep_pen"
    status, body = await _post(make_client, "/v1/completions", {"typical_p": 0.5})
    assert status == 400 and body["error"]["param"] == "typical_p"
    status, body = await _post(make_client, "/v1/completions", {"custom_token_bans": "1,x"})
    assert status == 400 and body["error"]["param"] == "custom_token_bans"


async def test_add_bos_token_reaches_a_prompt(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.script = static_script(["ok"])
    status, _ = await _post(make_client, "/v1/completions", {"add_bos_token": False})
    assert status == 200 and fake.submits[-1].add_bos is False
    status, _ = await _post(make_client, "/v1/completions", {})
    assert status == 200 and fake.submits[-1].add_bos is None


def sillytavern_tabby_body(prompt: str) -> dict[str, object]:
    """``getTextGenGenerationData`` for ``type: tabby`` (SillyTavern's
    ``public/scripts/textgen-settings.js``) with every sampler at its neutral
    value: the fields it sends and the values it sends them with."""
    return {
        "prompt": prompt,
        "model": "any",
        "max_new_tokens": 8,
        "max_tokens": 8,
        "temperature": 0,
        "top_p": 1,
        "typical_p": 1,
        "typical": 1,
        "sampler_seed": -1,
        "min_p": 0,
        "repetition_penalty": 1,
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "top_k": 0,
        "skew": 0,
        "min_tokens": 0,
        "add_bos_token": True,
        "smoothing_factor": 0,
        "smoothing_curve": 1,
        "dry_allowed_length": 2,
        "dry_multiplier": 0,
        "dry_base": 1.75,
        "dry_sequence_breakers": ["\n", ":", '"', "*"],
        "dry_penalty_last_n": 0,
        "max_tokens_second": 0,
        "stopping_strings": [],
        "stop": [],
        "truncation_length": 8192,
        "ban_eos_token": False,
        "skip_special_tokens": True,
        "top_a": 0,
        "tfs": 1,
        "mirostat_mode": 0,
        "mirostat_tau": 5,
        "mirostat_eta": 0.1,
        "custom_token_bans": "",
        "api_type": "tabby",
        "api_server": "http://127.0.0.1:8000",
        "legacy_api": False,
        "xtc_threshold": 0.1,
        "xtc_probability": 0,
        "n": 1,
        "rep_pen": 1,
        "rep_pen_range": -1,
        "repetition_decay": 0,
        "repetition_penalty_range": -1,
        "temperature_last": True,
        "speculative_ngram": False,
        "seed": -1,
        "guidance_scale": 1,
        "negative_prompt": "",
        "grammar_string": "",
        "json_schema": {},
        "repeat_penalty": 1,
        "tfs_z": 1,
        "repeat_last_n": -1,
        "n_predict": 8,
        "num_predict": 8,
        "num_ctx": 8192,
        "mirostat": 0,
        "ignore_eos": False,
        "rep_pen_slope": 1,
        "stream": True,
    }


async def test_sillytaverns_neutral_body_asks_for_the_plain_answer(
    make_client: MakeClient, fake: FakeEngineClient
) -> None:
    fake.script = static_script(["ok"])
    client = await make_client()
    r = await client.post("/v1/completions", json=sillytavern_tabby_body("Hello"))
    assert r.status == 200, await r.text()
    await r.read()
    st = fake.submits[-1]
    r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "temperature": 0})
    assert r.status == 200
    plain = fake.submits[-1]
    # Only what SillyTavern's neutral body states explicitly differs: BOS asked for, special tokens
    # skipped, temperature last (which at temperature 0, greedy, changes nothing).
    assert st.params == msgspec.structs.replace(
        plain.params,
        skip_special_tokens=True,
        temperature_last=True,
        dry_sequence_breakers=("\n", ":", '"', "*"),  # DRY's, with DRY off
    )
    assert (st.prompt, st.add_bos) == (plain.prompt, True)
