"""API keys: ``/v1/*`` requires one when any is configured, probes never do,
and no key ever reaches a log line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import openai
import pytest
from click.testing import CliRunner
from openai import AsyncOpenAI

from proxy.app import create_app
from proxy.cli import main
from proxy.server.intake import key_digest
from proxy.server.state import STATE
from tests.fakes.engine_client import FakeEngineClient, make_config
from tests.unit.proxy.conftest import MakeClient
from tests.unit.proxy.dialects.chat.test_http_chat import URL, body

KEYS = "sk-first-4f1a, sk-second-77b0"


async def test_without_keys_everything_is_open(make_client: MakeClient) -> None:
    client = await make_client()
    assert (await client.get("/v1/models")).status == 200
    assert (await client.post(URL, json=body())).status == 200


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer sk-wrong"},
        {"Authorization": "Basic c2stZmlyc3QtNGYxYQ=="},
        {"Authorization": "sk-first-4f1a"},
        {"x-api-key": "sk-first"},
        {"Authorization": "Bearer "},
    ],
)
async def test_missing_or_wrong_key_is_401(
    make_client: MakeClient, fake: FakeEngineClient, headers: dict[str, str]
) -> None:
    client = await make_client(api_key=KEYS)
    paths = (
        ("GET", "/v1/models"),
        ("POST", URL),
        ("GET", "/v1/nope"),
        # TabbyAPI's and llama.cpp's routes (proxy.dialects.tabby), admin ones included
        ("GET", "/v1/model"),
        ("GET", "/v1/model/list"),
        ("POST", "/v1/token/encode"),
        ("GET", "/v1/auth/permission"),
        ("GET", "/props"),
        ("POST", "/v1/model/load"),
    )
    for method, path in paths:
        r = await client.request(method, path, json=body(), headers=headers)
        assert r.status == 401, path
        assert r.headers["WWW-Authenticate"] == "Bearer"
        err = (await r.json())["error"]
        assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_api_key", None)
        assert "sk-" not in err["message"]
    assert fake.submits == []


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "Bearer sk-first-4f1a"},
        {"Authorization": "bearer  sk-second-77b0 "},
        {"x-api-key": "sk-second-77b0"},
        {"Authorization": "Bearer sk-wrong", "x-api-key": "sk-first-4f1a"},
    ],
)
async def test_a_configured_key_opens_v1(make_client: MakeClient, headers: dict[str, str]) -> None:
    client = await make_client(api_key=KEYS)
    assert (await client.get("/v1/models", headers=headers)).status == 200
    assert (await client.post(URL, json=body(), headers=headers)).status == 200
    assert await (await client.get("/v1/auth/permission", headers=headers)).json() == {"permission": "api"}


async def test_probes_stay_open(make_client: MakeClient) -> None:
    client = await make_client(api_key=KEYS)
    assert (await client.get("/health")).status == 200
    assert (await client.get("/ready")).status == 200


async def test_openai_sdk_sends_its_key(make_client: MakeClient) -> None:
    client = await make_client(api_key=KEYS)
    url = str(client.make_url("/v1"))
    messages: Any = [{"role": "user", "content": "x"}]
    async with AsyncOpenAI(base_url=url, api_key="sk-second-77b0", max_retries=0) as api:
        r = await api.chat.completions.create(model="m", messages=messages)
        assert r.choices[0].message.content == "Hello world"
    async with AsyncOpenAI(base_url=url, api_key="sk-nope", max_retries=0) as api:
        with pytest.raises(openai.AuthenticationError) as info:
            await api.chat.completions.create(model="m", messages=messages)
    assert info.value.code == "invalid_api_key"


async def test_keys_never_reach_the_logs(make_client: MakeClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    client = await make_client(api_key=KEYS)
    for key in ("sk-first-4f1a", "sk-wrong-1234"):
        await client.post(URL, json=body(), headers={"Authorization": f"Bearer {key}"})
        await client.get("/v1/models", headers={"x-api-key": key})
    assert caplog.records
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for secret in ("sk-first-4f1a", "sk-second-77b0", "sk-wrong-1234"):
        assert secret not in logged
    settings = make_config(api_key=KEYS)
    assert "sk-" not in repr(settings) and "sk-" not in str(settings)


def test_keys_from_the_variable_and_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nsk-file-1\n\n  sk-file-2  \n")
    monkeypatch.setenv("EXL3_SIDECAR_API_KEY", "sk-env-1,sk-env-2")
    from tests.unit.proxy.test_settings import parse

    settings = parse("--api-key-file", str(key_file))
    assert settings.api_keys() == {"sk-env-1", "sk-env-2", "sk-file-1", "sk-file-2"}
    app = create_app(settings, FakeEngineClient())  # reads the file once, here
    assert app[STATE].api_keys == {key_digest(k) for k in settings.api_keys()}


@pytest.mark.parametrize("content", [None, "", "# only a comment\n\n"])
def test_an_unusable_key_file_is_refused(tmp_path: Path, content: str | None) -> None:
    key_file = tmp_path / "keys"
    if content is not None:
        key_file.write_text(content)
    settings = make_config(api_key_file=key_file)
    with pytest.raises(ValueError, match="api_key_file"):
        settings.api_keys()
    with pytest.raises(ValueError, match="api_key_file"):
        create_app(settings, FakeEngineClient())
    r = CliRunner().invoke(main, ["--api-key-file", str(key_file)])
    assert r.exit_code == 2 and "api_key_file" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("value", ["", " , "])
def test_an_empty_key_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="api_key"):
        make_config(api_key=value)
    r = CliRunner().invoke(main, ["--api-key", value])
    assert r.exit_code == 2 and "api_key" in r.output
