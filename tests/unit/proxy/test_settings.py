"""The proxy's settings through its own command line (``exl3-sidecar proxy``)."""

from __future__ import annotations

import dataclasses

import pytest
from click.testing import CliRunner

from protocol.endpoints import default_addresses
from protocol.settings import env_var, flag, from_options
from proxy.cli import main
from proxy.settings import ProxySettings


def parse(*args: str) -> ProxySettings:
    return from_options(ProxySettings, main.make_context("proxy", list(args)).params)


def test_defaults_and_derived_names() -> None:
    s = parse()
    assert (s.host, s.port, s.sse_ping_interval, s.max_in_flight, s.shutdown_drain) == (
        "127.0.0.1",  # loopback unless asked: the pod manifest and the image set 0.0.0.0
        5000,
        15.0,
        256,
        20.0,
    )
    assert (s.max_body_mb, s.body_read_timeout, s.request_idle_timeout, s.max_n) == (None, 30.0, 600.0, 8)
    assert (s.api_key, s.api_key_file, s.api_keys()) == (None, None, frozenset())
    help_text = CliRunner().invoke(main, ["--help"]).output.replace("\n", "").replace(" ", "")
    for f in dataclasses.fields(ProxySettings):
        assert flag(f.name) in help_text and env_var(f.name) in help_text, f.name


def test_serve_listens_on_loopback_by_default_too() -> None:
    from launcher.cli import serve

    assert serve.make_context("serve", []).params["host"] == "127.0.0.1"


def test_env_var_and_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXL3_SIDECAR_PORT", "6001")
    monkeypatch.setenv("EXL3_SIDECAR_SHUTDOWN_DRAIN", "2.5")
    s = parse()
    assert s.port == 6001 and s.shutdown_drain == 2.5
    assert parse("--port", "6002").port == 6002


def test_addresses_default_to_the_private_runtime_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pytest.TempPathFactory
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = parse()
    assert s.input_addr is None and s.addresses == default_addresses()
    assert s.addresses[0] == f"ipc://{tmp_path}/exl3-sidecar/input.sock"
    assert parse("--input-addr", "tcp://127.0.0.1:1", "--output-addr", "tcp://127.0.0.1:2").addresses == (
        "tcp://127.0.0.1:1",
        "tcp://127.0.0.1:2",
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "--port"),
        (["--sse-ping-interval", "0"], "--sse-ping-interval"),
        (["--max-in-flight", "0"], "--max-in-flight"),
        (["--shutdown-drain", "-1"], "--shutdown-drain"),
        (["--max-n", "0"], "--max-n"),
        (["--max-body-mb", "0"], "--max-body-mb"),
        (["--body-read-timeout", "0"], "--body-read-timeout"),
        (["--request-idle-timeout", "-1"], "--request-idle-timeout"),
        (["--log-level", "loud"], "--log-level"),
        (["--backend", "cpu"], "No such option"),
    ],
)
def test_bad_values_are_usage_errors(args: list[str], message: str) -> None:
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output


@pytest.mark.parametrize(
    "bad", [{"port": -1}, {"heartbeat_timeout": 0.0}, {"request_queue_max": 0}, {"log_level": "loud"}]
)
def test_direct_construction_rejects_out_of_range(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        ProxySettings(**bad)  # type: ignore[arg-type]
