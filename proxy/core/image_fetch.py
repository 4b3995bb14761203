"""http(s) image URLs: fetched only where the operator allows it (``--allow-image-urls``).

A dialect turns an image part that names an http(s) URL into an ``ImageUrl``
(an ``ImageInput`` whose ``data`` is still empty); ``fetch_image`` replaces it
with the file before the image checks run (``proxy.core.images.check_images``).
Fetching what a client names from inside a cluster is a server-side request
forgery risk, so, in order, each refusal a 400 naming the part:

- off by default: a URL is refused, the client told to send a data URL;
- with ``ImageLimits.hosts`` set, a host outside it is refused (an entry
  ``.example.com`` takes the domain and its subdomains);
- a host that is an address, or resolves to addresses, none of them global
  (private, loopback, link-local, reserved: ``ipaddress``' ``is_global``) is
  refused unless listed by name in ``hosts``; the check is made by the resolver
  the connection itself uses, so a name cannot resolve to one address when
  checked and another when connected (DNS rebinding);
- at most ``MAX_REDIRECTS`` redirects, each new host held to the same rules;
- a status other than 200, a file over ``ImageLimits.bytes`` (by
  ``Content-Length`` or while reading), or a fetch over ``ImageLimits.timeout``
  seconds. Proxy environment variables are not used (``trust_env=False``).
"""

from __future__ import annotations

import ipaddress
import socket

import aiohttp
import yarl  # aiohttp's own URL type (a dependency of aiohttp): redirects join onto it
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from protocol.messages import ImageInput
from proxy.errors import InvalidRequest
from proxy.settings import MIB, ImageLimits

MAX_REDIRECTS = 3
"""Redirects one image URL may take."""

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK_BYTES = 64 * 1024


class ImageUrl(ImageInput, frozen=True):
    """An image part naming ``url`` (http or https), not fetched yet: ``data`` is
    empty. Never sent to the worker: ``fetch_image`` replaces it."""

    url: str = ""


def listed(host: str, hosts: tuple[str, ...]) -> bool:
    """``host`` is in the allow-list ``hosts`` (lower-case names; a leading dot: the
    domain and its subdomains)."""
    host = host.lower().rstrip(".")
    return any(host == h or (h.startswith(".") and (host.endswith(h) or host == h[1:])) for h in hosts)


class _GlobalOnly(AbstractResolver):
    """The connector's resolver: the addresses of a host not listed by name keep only
    the global ones; ``refused`` names a host that had none."""

    def __init__(self, hosts: tuple[str, ...]) -> None:
        self._inner = DefaultResolver()
        self._hosts = hosts
        self.refused: str | None = None

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        if listed(host, self._hosts):
            return results
        kept = [r for r in results if ipaddress.ip_address(r["host"]).is_global]
        if not kept:
            self.refused = host
            raise OSError(f"{host} resolves to no public address")
        return kept

    async def close(self) -> None:
        await self._inner.close()


def _check_url(url: yarl.URL, hosts: tuple[str, ...], param: str) -> None:
    host = url.host or ""
    if url.scheme not in ("http", "https") or not host:
        raise InvalidRequest(f"'{param}' must be an http(s) or data URL", param=param)
    if hosts and not listed(host, hosts):
        raise InvalidRequest(
            f"'{param}': images are fetched only from the hosts image_url_hosts lists, not {host}",
            param=param,
        )
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return  # a name: the resolver checks what it resolves to
    if not address.is_global and not listed(host, hosts):
        raise InvalidRequest(
            f"'{param}': {host} is not a public address; list it in image_url_hosts to fetch from it",
            param=param,
        )


async def fetch_image(image: ImageUrl, limits: ImageLimits) -> ImageInput:
    """The file ``image.url`` names, as an ``ImageInput`` at ``image``'s place.
    Raises ``InvalidRequest`` naming ``image.param`` (module docstring)."""
    param = image.param
    if not limits.fetch:
        raise InvalidRequest(
            f"'{param}' is an image URL; this server does not fetch images (allow_image_urls is off): "
            "send it inline as a data URL (data:image/png;base64,...)",
            param=param,
        )
    url = yarl.URL(image.url)
    resolver = _GlobalOnly(limits.hosts)
    connector = aiohttp.TCPConnector(resolver=resolver, limit=1)
    timeout = aiohttp.ClientTimeout(total=limits.timeout)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
            for _ in range(MAX_REDIRECTS + 1):
                _check_url(url, limits.hosts, param)
                async with session.get(url, allow_redirects=False) as resp:
                    location = resp.headers.get("Location")
                    if resp.status in _REDIRECTS and location:
                        url = url.join(yarl.URL(location))
                        continue
                    data = await _body(resp, limits.bytes, param)
                    return ImageInput(data, image.offset, param)
            raise InvalidRequest(f"'{param}': more than {MAX_REDIRECTS} redirects", param=param)
    except TimeoutError:
        raise InvalidRequest(
            f"'{param}' was not fetched within {limits.timeout:g} s (image_url_timeout)", param=param
        ) from None
    except aiohttp.ClientError as e:
        if resolver.refused is not None:
            message = f"{resolver.refused} resolves to no public address; list it in image_url_hosts"
        else:
            message = f"could not be fetched ({type(e).__name__})"
        raise InvalidRequest(f"'{param}': {message}", param=param) from None


async def _body(resp: aiohttp.ClientResponse, most: int, param: str) -> bytes:
    if resp.status != 200:
        raise InvalidRequest(f"'{param}': the image URL answered {resp.status}", param=param)
    too_big = f"'{param}' is over {most / MIB:.1f} MiB (max_image_mb)"
    if resp.content_length is not None and resp.content_length > most:
        raise InvalidRequest(too_big, param=param)
    data = bytearray()
    async for chunk in resp.content.iter_chunked(_CHUNK_BYTES):
        data += chunk
        if len(data) > most:
            raise InvalidRequest(too_big, param=param)
    return bytes(data)
