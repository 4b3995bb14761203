"""Cross-origin calls from web pages (CORS), opt-in with ``--allowed-origins``.

A browser lets a page on one origin read a response of another only when the
response says so (``Access-Control-Allow-Origin``), and before a request with a
JSON body or an ``Authorization`` header it asks first: an ``OPTIONS`` preflight
naming the method and headers it will send (the Fetch standard's CORS protocol).
Without the option this server says nothing of the sort, so no page on another
origin can call it (llama.cpp's server allows every origin; vLLM allows those of
``--allowed-origins``, all by default; here none by default, since a keyless
server on loopback is reachable by every page a local browser opens).

With ``ProxySettings.allowed_origins`` (comma-separated origins compared without
case and a trailing slash, ``*`` for any):

- a preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``)
  from an allowed origin, on a route that exists, is 204 with
  ``Access-Control-Allow-Origin`` (the origin, or ``*``),
  ``Access-Control-Allow-Methods: GET, POST, OPTIONS``, the requested headers in
  ``Access-Control-Allow-Headers`` and ``Access-Control-Max-Age: 600``; it needs
  no API key (a browser sends none with a preflight). From another origin it is
  403 ``origin_not_allowed`` naming it;
- every response to a request whose ``Origin`` is allowed (errors and streams
  included: the headers are added as the response is prepared) carries
  ``Access-Control-Allow-Origin``, ``Vary: Origin`` and
  ``Access-Control-Expose-Headers: Retry-After``;
- the Host/Origin check (``proxy.server.host_check``) accepts an allowed origin's
  ``Origin`` header: listing an origin is the operator's say that its pages may
  call. ``Host`` is checked as before, so DNS rebinding stays refused. No
  credentials mode (cookies) is offered: API keys go in headers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy.errors import ProxyError
from proxy.settings import ProxySettings

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ALLOW_METHODS = "GET, POST, OPTIONS"
MAX_AGE_S = 600
_MAX_REQUESTED_HEADERS = 1024  # characters of Access-Control-Request-Headers echoed back


class OriginNotAllowed(ProxyError):
    """A preflight from an origin not in ``--allowed-origins`` (403)."""

    status = 403
    type = "invalid_request_error"
    default_code = "origin_not_allowed"


def _normal(origin: str) -> str:
    return origin.strip().lower().rstrip("/")


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """The origins whose pages may call: ``origins`` (normalized), or any with ``any_origin``."""

    origins: frozenset[str]
    any_origin: bool

    @classmethod
    def from_settings(cls, settings: ProxySettings) -> CorsPolicy | None:
        """The policy of ``settings.allowed_origins``; ``None`` when unset (no CORS)."""
        if not settings.allowed_origins:
            return None
        names = frozenset(_normal(o) for o in settings.allowed_origins.split(",") if o.strip())
        return cls(names - {"*"}, "*" in names)

    def allows(self, origin: str) -> bool:
        """Whether a page of ``origin`` (an ``Origin`` header's value) may call."""
        return self.any_origin or _normal(origin) in self.origins

    def allow_origin(self, origin: str) -> str:
        return "*" if self.any_origin else origin.strip()


def cors_middlewares(settings: ProxySettings) -> tuple[Middleware, ...]:
    """The middleware answering preflights (place it inside the error middleware,
    before the Host and API-key checks), or none without ``allowed_origins``."""
    policy = CorsPolicy.from_settings(settings)
    if policy is None:
        return ()

    @web.middleware
    async def preflight_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if (
            request.method != "OPTIONS"
            or origin is None
            or "Access-Control-Request-Method" not in request.headers
            or (
                request.match_info.http_exception is not None
                and request.match_info.http_exception.status == 404
            )
        ):
            return await handler(request)
        if not policy.allows(origin):
            raise OriginNotAllowed(f"Origin {origin[:200]!r} is not allowed: see --allowed-origins")
        asked = request.headers.get("Access-Control-Request-Headers", "")[:_MAX_REQUESTED_HEADERS]
        headers = {
            "Access-Control-Allow-Methods": ALLOW_METHODS,
            "Access-Control-Max-Age": str(MAX_AGE_S),
        }
        if asked.strip():
            headers["Access-Control-Allow-Headers"] = asked
        return web.Response(status=204, headers=headers)

    return (preflight_middleware,)


def install_cors_headers(app: web.Application, settings: ProxySettings) -> CorsPolicy | None:
    """Adds the CORS response headers to every response of ``app`` to an allowed
    ``Origin`` (an ``on_response_prepare`` hook: streams and errors too). Returns
    the policy, ``None`` without ``allowed_origins``."""
    policy = CorsPolicy.from_settings(settings)
    if policy is None:
        return None

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or not policy.allows(origin):
            return
        response.headers["Access-Control-Allow-Origin"] = policy.allow_origin(origin)
        response.headers["Access-Control-Expose-Headers"] = "Retry-After"
        vary = response.headers.get("Vary")
        if vary is None:
            response.headers["Vary"] = "Origin"
        elif "origin" not in vary.lower():
            response.headers["Vary"] = f"{vary}, Origin"

    app.on_response_prepare.append(add_headers)
    return policy
