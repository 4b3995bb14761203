"""Waiting for a server that is still starting: what ``chat`` and ``top`` do first.

Run right after ``exl3-sidecar serve``, a client used to fail at once ("handshake
pending, worker down or restarting", or connection refused while the proxy was
still importing). Now it asks ``GET /ready`` (at the server's root: the base URL
without its ``/v1``) and, while that says the server is loading, prints one line
per stage and polls again, for at most ``within`` seconds:

- 200, or any answer that is not this server's 503 (llama.cpp's and vLLM's servers
  have no ``/ready``: 404): go on at once;
- 503 ``{"status": "loading", "loading": {...}}`` (``proxy.ops.routes.ready``): a
  line naming the stage when it changes, e.g. ``waiting for the server: load
  weights (SmolLM2-135M-Instruct), 9.2 s into the start``;
- 503 ``not_ready`` (no worker yet, or a restart): ``waiting for the server's
  engine worker``;
- connection refused: the proxy may not listen yet, for at most
  ``CONNECT_GRACE_S`` (a wrong port should not hang for minutes).

Then the caller goes on; whatever is still wrong, its request reports.
``draining`` is not waited for: the server is going away.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import click
import httpx
import msgspec

POLL_S = 0.5
CONNECT_GRACE_S = 5.0
"""Seconds a refused connection is retried: ``serve`` listens within a few seconds."""


class _Loading(msgspec.Struct):
    stage: str = ""
    label: str = ""
    done: int = 0
    total: int = 0
    load_s: float = 0.0


class _ReadyBody(msgspec.Struct):
    status: str = ""
    loading: _Loading | None = None


_decoder = msgspec.json.Decoder(_ReadyBody)


wait_option = click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0),
    default=300.0,
    show_default=True,
    help="Seconds to wait for a server that is still loading (GET /ready), a line per stage; 0: not at all.",
)
"""``--wait`` of the clients that talk to a server (``chat``, ``top``)."""


def ready_url(base_url: str) -> str:
    """``GET /ready``'s URL for an OpenAI base URL (``http://h:p/v1`` -> ``http://h:p/ready``)."""
    root = base_url.rstrip("/")
    root = root.removesuffix("/v1")
    return root + "/ready"


def wait_until_ready(
    client: httpx.Client,
    say: Callable[[str], None],
    *,
    within: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Poll ``client``'s server until it is not loading (see the module docstring),
    saying each new stage once with ``say``; at most ``within`` seconds. Returns
    whether it waited at all."""
    url = ready_url(str(client.base_url))
    started = clock()
    last: str | None = None  # the stage (or state) said last
    while True:
        try:
            response = client.get(url)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            if clock() - started >= min(within, CONNECT_GRACE_S):
                return last is not None
            key, line = "listen", "waiting for the server to listen"
        except httpx.TransportError:
            return last is not None
        else:
            waiting = _waiting(response)
            if waiting is None:
                return last is not None
            key, line = waiting
        if key != last:
            say(line)
            last = key
        if clock() - started >= within:
            say(f"gave up waiting after {within:g} s (--wait)")
            return True
        sleep(POLL_S)


def _waiting(response: httpx.Response) -> tuple[str, str] | None:
    """``(stage, line to say)`` while this server is loading, else ``None``."""
    if response.status_code != 503:
        return None
    try:
        body = _decoder.decode(response.content)
    except msgspec.MsgspecError:
        return None
    if body.status == "loading" and body.loading is not None:
        ld = body.loading
        count = f" ({ld.done}/{ld.total})" if ld.total else ""
        return (
            ld.stage,
            f"waiting for the server: {ld.label or ld.stage}{count}, {ld.load_s:.1f} s into its start",
        )
    if body.status == "not_ready":
        return "not_ready", "waiting for the server's engine worker to start"
    return None
