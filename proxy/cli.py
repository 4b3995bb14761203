"""``exl3-sidecar proxy`` (also ``python -m proxy``): run the HTTP proxy alone,
the sidecar container of a pod. Options come from ``proxy.settings.ProxySettings``."""

from __future__ import annotations

import logging
from typing import Any

import click

from protocol.logs import setup_logging
from protocol.settings import click_options, from_options
from proxy.settings import ProxySettings


def settings_from_options(values: dict[str, Any]) -> ProxySettings:
    """``ProxySettings`` from click's values, the API key file read once to check
    it. Raises ``click.UsageError`` for a bad value or an unreadable key file."""
    settings = from_options(ProxySettings, values)
    try:
        settings.api_keys()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return settings


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click_options(ProxySettings)
def main(**values: Any) -> None:
    """Run the HTTP proxy alone (the sidecar container of a pod)."""
    settings = settings_from_options(values)
    setup_logging(settings.log_level, settings.log_format)
    from proxy.app import run_proxy
    from proxy.engine.client import ZmqEngineClient
    from proxy.server.runner import run

    try:
        run(run_proxy(settings, ZmqEngineClient(settings)))
    except OSError as e:
        exit_on_bind_error(settings, e)


def exit_on_bind_error(settings: ProxySettings, e: OSError) -> None:
    """A listener that cannot be bound (port in use, no such address) is an
    operator error: one line naming the setting, exit status 1."""
    logging.getLogger("exl3_sidecar").error(
        "cannot listen on %s:%d (host, port): %s", settings.host, settings.port, e.strerror or e
    )
    raise SystemExit(1) from None
