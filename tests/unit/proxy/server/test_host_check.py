"""The DNS-rebinding guard (``proxy.server.host_check``): with no API key, ``Host`` and
``Origin`` must name loopback or ``--allowed-hosts``; refused with 403 in the
OpenAI envelope naming the host."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from proxy.server.host_check import HostPolicy, is_loopback
from tests.fakes.engine_client import make_config
from tests.unit.proxy.conftest import MakeClient

LOOPBACK_HOSTS = ["localhost", "localhost:5000", "LOCALHOST.", "app.localhost:8080", "127.0.0.1:5000",
                  "127.9.8.7", "[::1]:5000", "[::1]"]  # fmt: skip
FOREIGN_HOSTS = ["evil.example", "evil.example:5000", "127.0.0.1.evil.example", "localhost.evil.example",
                 "10.0.0.5:5000", "[::2]:5000", "0.0.0.0", ""]  # fmt: skip


async def models(client: TestClient[Any, Any], **headers: str) -> tuple[int, dict[str, Any]]:
    r = await client.get("/v1/models", headers=headers)
    return r.status, await r.json()


@pytest.mark.parametrize("host", LOOPBACK_HOSTS)
async def test_loopback_hosts_are_answered(make_client: MakeClient, host: str) -> None:
    client = await make_client()
    status, _ = await models(client, Host=host)
    assert status == 200


@pytest.mark.parametrize("host", FOREIGN_HOSTS)
async def test_a_foreign_host_is_403_naming_it(make_client: MakeClient, host: str) -> None:
    client = await make_client()
    status, body = await models(client, Host=host)
    assert status == 403
    error = body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "host_not_allowed"
    assert error["param"] is None
    assert f"Host {host!r} is not allowed" in error["message"]


@pytest.mark.parametrize(
    ("origin", "status"),
    [
        ("http://localhost:3000", 200),
        ("http://127.0.0.1:5000", 200),
        ("https://[::1]", 200),
        ("http://evil.example", 403),
        ("http://evil.example:5000", 403),
        ("null", 403),
        ("not a url", 403),
    ],
)
async def test_origin_when_present_must_be_allowed(make_client: MakeClient, origin: str, status: int) -> None:
    client = await make_client()
    got, body = await models(client, Host="localhost:5000", Origin=origin)
    assert got == status
    if status == 403:
        assert f"Origin {origin!r}" in body["error"]["message"]


async def test_probes_and_metrics_answer_any_host(make_client: MakeClient) -> None:
    client = await make_client()
    for path in ("/health", "/ready", "/metrics"):
        r = await client.get(path, headers={"Host": "10.1.2.3:5000"})  # a kubelet's probe
        assert r.status != 403, path


async def test_allowed_hosts_are_answered_besides_loopback(make_client: MakeClient) -> None:
    client = await make_client(allowed_hosts="sidecar.models.svc, Sidecar.Example:443")
    assert (await models(client, Host="sidecar.models.svc:5000"))[0] == 200
    assert (await models(client, Host="sidecar.example"))[0] == 200
    assert (await models(client, Host="localhost"))[0] == 200
    assert (await models(client, Host="evil.example"))[0] == 403
    assert (await models(client, Host="sidecar.models.svc", Origin="http://sidecar.example"))[0] == 200


async def test_star_allows_any_host(make_client: MakeClient) -> None:
    client = await make_client(allowed_hosts="*")
    assert (await models(client, Host="evil.example", Origin="http://evil.example"))[0] == 200


async def test_with_an_api_key_the_key_is_the_check(make_client: MakeClient) -> None:
    client = await make_client(api_key="k1")
    status, _ = await models(client, Host="evil.example")
    assert status == 401  # no key: refused for that, not for the host
    status, _ = await models(client, Host="evil.example", Authorization="Bearer k1")
    assert status == 200


async def test_a_listener_on_every_interface_is_not_checked_unless_asked(make_client: MakeClient) -> None:
    # The container image and the Kubernetes manifests: reached by Service names.
    client = await make_client(host="0.0.0.0")
    assert (await models(client, Host="exl3-sidecar.default.svc.cluster.local:5000"))[0] == 200
    client = await make_client(host="0.0.0.0", allowed_hosts="exl3-sidecar")
    assert (await models(client, Host="exl3-sidecar:5000"))[0] == 200
    assert (await models(client, Host="evil.example"))[0] == 403


@pytest.mark.parametrize(
    ("host", "allowed_hosts", "keys", "checked"),
    [
        ("127.0.0.1", None, False, True),
        ("localhost", None, False, True),
        ("::1", None, False, True),
        ("0.0.0.0", None, False, False),
        ("::", None, False, False),
        ("10.0.0.5", None, False, False),
        ("0.0.0.0", "a.example", False, True),
        ("127.0.0.1", "*", False, False),
        ("127.0.0.1", "a.example,*", False, False),
        ("127.0.0.1", None, True, False),
    ],
)
def test_when_the_check_applies(host: str, allowed_hosts: str | None, keys: bool, checked: bool) -> None:
    policy = HostPolicy.from_settings(make_config(host=host, allowed_hosts=allowed_hosts), has_keys=keys)
    assert (policy is not None) is checked


def test_loopback_names() -> None:
    assert all(is_loopback(h) for h in ("localhost", "a.b.localhost", "127.0.0.1", "127.255.0.1", "::1"))
    assert not any(is_loopback(h) for h in ("localhost.example", "128.0.0.1", "0.0.0.0", "::", "", "example"))
