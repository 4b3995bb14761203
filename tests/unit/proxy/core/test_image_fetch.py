"""``proxy.core.image_fetch``: image URLs fetched only where allowed, and never from
an address inside the cluster unless the operator listed it; every refusal names
the part. Served by a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from protocol.messages import MODALITY_IMAGE, MODALITY_TEXT, ChatMessage, ImageInput, SamplingParams, Submit
from proxy.core.image_fetch import ImageUrl, fetch_image, listed
from proxy.core.images import check_images, data_url_image
from proxy.errors import InvalidRequest
from proxy.settings import ImageLimits, ProxySettings
from tests.fakes.engine_client import WORKER
from tests.unit.proxy.core.test_images import picture

PNG = picture()
PART = "messages[0].content[1]"
VISION = msgspec.structs.replace(WORKER, modalities=(MODALITY_TEXT, MODALITY_IMAGE))


@pytest.fixture
async def origin() -> AsyncIterator[str]:
    """``http://127.0.0.1:<port>``: ``/cat.png``, ``/big`` (2 MiB), ``/slow``, ``/missing``
    (404), ``/hop/<n>`` (redirects down to ``/cat.png``), ``/away`` (a redirect to
    ``localhost``, a name for the same loopback address)."""

    async def cat(_: web.Request) -> web.Response:
        return web.Response(body=PNG, content_type="image/png")

    async def big(_: web.Request) -> web.Response:
        return web.Response(body=b"\0" * (2 << 20))

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(body=PNG)

    async def hop(request: web.Request) -> web.Response:
        n = int(request.match_info["n"])
        raise web.HTTPFound("/cat.png" if n == 0 else f"/hop/{n - 1}")

    async def away(request: web.Request) -> web.Response:
        raise web.HTTPFound(f"http://localhost:{request.url.port}/cat.png")

    app = web.Application()
    app.router.add_get("/cat.png", cat)
    app.router.add_get("/big", big)
    app.router.add_get("/slow", slow)
    app.router.add_get("/hop/{n}", hop)
    app.router.add_get("/away", away)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield f"http://127.0.0.1:{server.port}"
    await server.close()


def limits(hosts: tuple[str, ...] = ("127.0.0.1",), fetch: bool = True, timeout: float = 2.0) -> ImageLimits:
    return ImageLimits(4, 1 << 20, 1_000_000, fetch=fetch, hosts=hosts, timeout=timeout)


async def refusal(url: str, lim: ImageLimits) -> str:
    with pytest.raises(InvalidRequest) as info:
        await fetch_image(ImageUrl(b"", 3, PART, url), lim)
    assert info.value.param == PART and f"'{PART}'" in info.value.message
    return info.value.message


def test_the_allow_list() -> None:
    hosts = ("images.example.com", ".cdn.example.org")
    assert listed("images.example.com", hosts) and listed("IMAGES.example.com.", hosts)
    assert listed("cdn.example.org", hosts) and listed("a.b.cdn.example.org", hosts)
    assert not listed("example.com", hosts) and not listed("evilcdn.example.org", hosts)
    assert ProxySettings(image_url_hosts=" A.example , .b.example,").image_limits().hosts == (
        "a.example",
        ".b.example",
    )


async def test_a_listed_host_is_fetched_through_redirects(origin: str) -> None:
    url = data_url_image(f"{origin}/hop/2", PART, 3)
    assert isinstance(url, ImageUrl) and url.data == b""
    assert await fetch_image(url, limits()) == ImageInput(PNG, 3, PART)
    assert "more than 3 redirects" in await refusal(f"{origin}/hop/3", limits())


async def test_off_by_default_and_outside_the_list(origin: str) -> None:
    assert "allow_image_urls is off" in await refusal(f"{origin}/cat.png", limits(fetch=False))
    assert "image_url_hosts lists, not 127.0.0.1" in await refusal(
        f"{origin}/cat.png", limits(("x.example",))
    )


async def test_no_private_address_unless_listed(origin: str) -> None:
    # Any host allowed (no list), but loopback is not public: refused as an address...
    assert "127.0.0.1 is not a public address" in await refusal(f"{origin}/cat.png", limits(()))
    for private in ("http://10.1.2.3/a.png", "http://169.254.169.254/latest", "http://[::1]/a.png"):
        assert "not a public address" in await refusal(private, limits(()))
    # ...and as a name that resolves to it (checked by the connection's own resolver).
    port = origin.rsplit(":", 1)[1]
    message = await refusal(f"http://localhost:{port}/cat.png", limits(()))
    assert "localhost resolves to no public address" in message
    # A redirect's host is held to the list too.
    assert "not localhost" in await refusal(f"{origin}/away", limits(("127.0.0.1",)))
    assert await fetch_image(ImageUrl(b"", 0, PART, f"{origin}/away"), limits(("127.0.0.1", "localhost")))


async def test_size_status_and_time_are_bounded(origin: str) -> None:
    assert "max_image_mb" in await refusal(f"{origin}/big", limits())
    assert "answered 404" in await refusal(f"{origin}/missing", limits())
    assert "within 0.2 s (image_url_timeout)" in await refusal(f"{origin}/slow", limits(timeout=0.2))


async def test_check_images_fetches_then_checks(origin: str) -> None:
    submit = Submit(
        "r",
        SamplingParams(4),
        messages=(ChatMessage("user", "a\n\nb", images=(ImageUrl(b"", 2, PART, f"{origin}/cat.png"),)),),
    )
    (out,) = await check_images([submit], VISION, limits())
    assert out.messages[0].images == (ImageInput(PNG, 2, PART),)
    assert type(out.messages[0].images[0]) is ImageInput  # what the worker is sent has no URL
    with pytest.raises(InvalidRequest) as info:  # a text-only model: refused before any fetch
        await check_images([submit], WORKER, limits(fetch=False))
    assert "reads text only" in info.value.message
