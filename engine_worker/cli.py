"""``python -m engine_worker`` (also ``exl3-sidecar worker``): run the engine
worker, one container of a pod. Options come from
``engine_worker.settings.WorkerSettings``."""

from __future__ import annotations

from typing import Any

import click

from engine_worker.settings import FOREIGN_OPTIONS, WorkerSettings
from protocol.logs import setup_logging
from protocol.settings import HintedCommand, click_options, from_options


@click.command(
    cls=HintedCommand,
    hints=FOREIGN_OPTIONS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
@click_options(WorkerSettings)
@click.option(
    "--check",
    is_flag=True,
    help="Validate the options (flags and EXL3_SIDECAR_* variables, the model folder on disk) and exit "
    "without loading a model.",
)
def main(check: bool, **values: Any) -> None:
    """Run the engine worker: load the model, bind the ZeroMQ sockets, serve the proxy.

    Flags of llama.cpp and vLLM for the same settings are accepted beside this
    server's (-m/--model, -c/--ctx-size/--max-model-len, -np/--parallel/--max-num-seqs,
    -t, -ngl/--n-gpu-layers); others are refused with the option to use instead."""
    settings = from_options(WorkerSettings, values)
    try:
        # Before any model loads: a wrong folder is a usage error (exit status 2),
        # not a load failure that a supervisor would retry.
        settings.check_paths()
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if check:
        return
    setup_logging(settings.log_level, settings.log_format)
    from engine_worker.main import run_worker

    run_worker(settings)
