"""``python -m engine_worker`` (also ``exl3-sidecar worker``): run the engine
worker, one container of a pod. Options come from
``engine_worker.settings.WorkerSettings``."""

from __future__ import annotations

from typing import Any

import click

from engine_worker.settings import WorkerSettings
from protocol.logs import setup_logging
from protocol.settings import click_options, from_options


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click_options(WorkerSettings)
@click.option(
    "--check",
    is_flag=True,
    help="Validate the options (flags and EXL3_SIDECAR_* variables) and exit without loading a model.",
)
def main(check: bool, **values: Any) -> None:
    """Run the engine worker: load the model, bind the ZeroMQ sockets, serve the proxy."""
    settings = from_options(WorkerSettings, values)
    if check:
        return
    setup_logging(settings.log_level, settings.log_format)
    from engine_worker.main import run_worker

    run_worker(settings)
