"""The guard against DNS rebinding: which ``Host`` and ``Origin`` a keyless server answers.

A web page cannot read the answers of a server on another origin, unless it
makes its own name resolve to that server (DNS rebinding): its requests then
carry ``Host: its-name`` (and ``Origin: http://its-name``). A server that needs
no API key and trusts any ``Host`` answers them. So, as Jupyter's
``allow_remote_access`` and Ollama's allowed-hosts check do, a keyless proxy
listening on a loopback address answers only loopback names:

- ``localhost`` and names under ``.localhost`` (RFC 6761: browsers resolve them
  to loopback themselves), addresses in ``127.0.0.0/8``, ``::1``;
- plus ``ProxySettings.allowed_hosts`` (comma-separated names or addresses,
  compared without the port and case; ``*`` accepts any).

An ``Origin`` header, when present, must name one of those hosts too (``null``
does not), or be one of ``ProxySettings.allowed_origins`` (``proxy.server.cors``:
pages the operator lets call). Anything else is 403 ``host_not_allowed``,
naming the host.

The check applies when no API key is configured and either ``allowed_hosts``
is set or the listener (``ProxySettings.host``) is a loopback address. A proxy
listening on other interfaces (``0.0.0.0`` in the container image and the
Kubernetes manifests, reached by Service names and pod addresses) is not
checked unless ``allowed_hosts`` is given: it is on a network already, where a
key or a gateway is the control. ``PROBE_PATHS`` (the probes and the scrape,
open without a key too) are never checked: a kubelet's probe carries the pod's
address as its ``Host``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy.errors import ProxyError
from proxy.server.cors import CorsPolicy
from proxy.server.probes import PROBE_PATHS
from proxy.settings import ProxySettings

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class HostNotAllowed(ProxyError):
    """``Host`` or ``Origin`` names a host this keyless server does not answer (403)."""

    status = 403
    type = "invalid_request_error"
    default_code = "host_not_allowed"


def _hostname(value: str) -> str:
    """``value`` (a ``Host`` header: ``name``, ``name:port``, ``[v6]:port``)
    without its port and brackets, in lower case, without a trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):
        value = value[1:].split("]", 1)[0]
    elif value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (without port) is a loopback name or address."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class HostPolicy:
    """The hosts a keyless server answers besides loopback ones: ``allowed``
    (lower case, no port)."""

    allowed: frozenset[str]
    origins: CorsPolicy | None = None
    """``--allowed-origins``: their ``Origin`` passes too."""

    @classmethod
    def from_settings(cls, settings: ProxySettings, has_keys: bool) -> HostPolicy | None:
        """The policy ``settings`` ask for, or ``None`` when nothing is checked
        (module docstring: a key is set, ``allowed_hosts`` is ``*``, or it is
        unset and the listener is not a loopback address)."""
        if has_keys:
            return None
        origins = CorsPolicy.from_settings(settings)
        if settings.allowed_hosts is None:
            return cls(frozenset(), origins) if is_loopback(_hostname(settings.host)) else None
        names = frozenset(_hostname(h) for h in settings.allowed_hosts.split(",") if h.strip())
        if "*" in names:
            return None
        return cls(names, origins)

    def allows(self, host: str) -> bool:
        """Whether ``host`` (without port) is answered."""
        return is_loopback(host) or host in self.allowed

    def check(self, request: web.Request) -> None:
        """Raises ``HostNotAllowed`` naming the ``Host`` or ``Origin`` refused.
        A request without ``Host`` (HTTP/1.0; no browser sends one) passes."""
        host = request.headers.get("Host")
        if host is not None and not self.allows(_hostname(host)):
            raise HostNotAllowed(
                f"Host {_shown(host)} is not allowed: this server without an API key answers "
                "loopback names and --allowed-hosts"
            )
        origin = request.headers.get("Origin")
        if origin is not None and not (self.origins is not None and self.origins.allows(origin)):
            try:
                origin_host = urlsplit(origin.strip()).hostname
            except ValueError:
                origin_host = None
            if not origin_host or not self.allows(origin_host.rstrip(".")):
                raise HostNotAllowed(
                    f"Origin {_shown(origin)} is not allowed: this server without an API key answers "
                    "loopback names, --allowed-hosts and --allowed-origins"
                )


def _shown(value: str) -> str:
    return repr(value[:200])


def host_check_middlewares(settings: ProxySettings, has_keys: bool) -> tuple[Middleware, ...]:
    """The middleware enforcing ``HostPolicy.from_settings(settings, has_keys)``
    on every path but ``PROBE_PATHS``, or none when nothing is checked. Place it
    inside the error middleware: its ``HostNotAllowed`` becomes the envelope."""
    policy = HostPolicy.from_settings(settings, has_keys)
    if policy is None:
        return ()

    @web.middleware
    async def host_check_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        if request.path not in PROBE_PATHS:
            policy.check(request)
        return await handler(request)

    return (host_check_middleware,)
