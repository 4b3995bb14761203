"""The ``exl3-sidecar top`` command: options, which view, exit status."""

from __future__ import annotations

import contextlib
import os
import sys

import click

from launcher.chat.command import EXIT_ERROR, EXIT_INTERRUPTED, base_url_of, server_options
from launcher.wait import wait_option

DEFAULT_INTERVAL_S = 1.0


@click.command(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
    short_help="Watch what a server is doing: its load and every request in flight.",
)
@server_options
@click.option(
    "--api-key",
    help="Sent as 'Authorization: Bearer KEY'. Default: $EXL3_SIDECAR_API_KEY (its first key), "
    "else $OPENAI_API_KEY. Prefer the variables: a command line shows up in ps.",
)
@click.option(
    "--interval",
    type=click.FloatRange(0.25, 60),
    default=DEFAULT_INTERVAL_S,
    show_default=True,
    help="Seconds between snapshots.",
)
@click.option(
    "--sort",
    "sort_by",
    type=click.Choice(["stage", "age", "tokens", "rate"]),
    default="stage",
    show_default=True,
    help="Order of the requests (the s key cycles on a terminal).",
)
@click.option("--once", is_flag=True, help="Print one snapshot as plain lines and exit.")
@click.option("--plain", is_flag=True, help="Plain lines even on a terminal.")
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Seconds the server may send nothing before the client gives up.",
)
@wait_option
def top(
    base_url: str | None,
    port: int | None,
    api_key: str | None,
    interval: float,
    sort_by: str,
    once: bool,
    plain: bool,
    timeout: float,
    wait_s: float,
) -> None:
    """Watch an exl3-sidecar server: the worker's load and every request in flight.

    Follows GET /v1/status as a stream (a snapshot per --interval). On a terminal: a
    header with the worker's batch slots, KV cache and queue, the rates of the last
    interval (requests, prefill and decode tokens per second) and the cache and draft
    ratios, then a table of the requests by stage (decode, prefill, queued by
    position) with bars for the queue and the prefill. Keys: s sorts by the next
    order (stage, age, tokens, rate), q quits. In a pipe (or with --plain) each
    snapshot is a block of plain lines on stdout; --once prints one and exits.

    Exit status: 0 quit (or the server ended the stream: it is shutting down), 1
    error, 2 bad usage, 130 interrupted.
    """
    from launcher.chat.client import ChatError, open_client
    from launcher.chat.command import _env_api_key
    from launcher.top.client import fetch_status, stream_status
    from launcher.top.plain import PlainView

    url = base_url_of(base_url, port)
    code = 0
    try:
        key = api_key or _env_api_key("chat")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with open_client(url, headers, timeout + interval) as client:
            if wait_s > 0:
                from launcher.wait import wait_until_ready

                wait_until_ready(client, lambda line: click.echo(line, err=True), within=wait_s)
            if once:
                PlainView(sys.stdout, sort_by).show(fetch_status(client))
            elif plain or not _is_terminal():
                view = PlainView(sys.stdout, sort_by)
                for st in stream_status(client, interval):
                    view.show(st)
            else:
                from rich.console import Console

                from launcher.top import terminal

                def ended(why: str) -> None:
                    click.echo(why, err=True)

                terminal.run(stream_status(client, interval), Console(), sort_by, ended)
    except ChatError as e:
        click.echo(f"error: {e}", err=True)
        code = EXIT_ERROR
    except BrokenPipeError:
        _silence_stdout()
        code = EXIT_ERROR
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    if code:
        raise SystemExit(code)


def _is_terminal() -> bool:
    return sys.stdout.isatty() and sys.stdin.isatty() and os.environ.get("TERM") != "dumb"


def _silence_stdout() -> None:
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
