"""The ``exl3-sidecar`` commands: ``serve``, ``worker``, ``proxy``, ``chat``, ``top``
(see the package docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
from typing import Any

import click

from launcher.chat import chat as chat_command
from launcher.supervisor import WorkerNeverServed, WorkerSupervisor
from launcher.top import top as top_command
from protocol.endpoints import default_addresses, instance_dir
from protocol.logs import setup_logging
from protocol.settings import cli_args, click_options
from proxy.cli import exit_on_bind_error, settings_from_options
from proxy.cli import main as proxy_command
from proxy.settings import ProxySettings

WORKER_COMMAND = (sys.executable, "-m", "engine_worker")
"""How the worker is started: by its command line, never by importing it."""

WORKER_AS_SUBCOMMAND = (
    sys.executable,
    "-c",
    "from engine_worker.cli import main; main(prog_name='exl3-sidecar worker')",
)
"""``exl3-sidecar worker``: the same command, named as the user typed it in its
usage line and errors (``python -m engine_worker`` names itself)."""

WORKER_CHECK_UNDER_SERVE = (
    sys.executable,
    "-c",
    "from engine_worker.cli import main; main(prog_name='exl3-sidecar serve')",
    "--check",
)
"""``serve``'s check of its worker options: a usage error names ``exl3-sidecar serve``,
the command the user typed, not ``python -m engine_worker``."""

_CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


@click.group(context_settings=_CONTEXT)
def main() -> None:
    """OpenAI-compatible server that streams prefill progress and reports prefix-cache and draft usage."""


main.add_command(proxy_command, "proxy")
main.add_command(chat_command, "chat")
main.add_command(top_command, "top")


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def worker(args: tuple[str, ...]) -> None:
    """Run the engine worker alone (one container of a pod): python -m engine_worker ARGS.
    Its options: exl3-sidecar worker --help."""
    os.execv(WORKER_AS_SUBCOMMAND[0], [*WORKER_AS_SUBCOMMAND, *args])


@main.command(
    context_settings={**_CONTEXT, "ignore_unknown_options": True, "allow_extra_args": True},
    epilog="Every other option is the worker's (exl3-sidecar worker --help lists them, e.g. --backend, "
    "--model-dir, --draft-mode, and the llama.cpp and vLLM names it takes: -m/--model, -c/--ctx-size, "
    "--max-model-len, --parallel, --max-num-seqs, --n-gpu-layers); they are checked, the model folder "
    "included, before anything starts. A worker that exits before it ever served stops serve (status 1); "
    "one that dies after serving is restarted.",
)
@click_options(ProxySettings)
@click.argument("worker_args", nargs=-1, type=click.UNPROCESSED)
def serve(worker_args: tuple[str, ...], **values: Any) -> None:
    """Run worker and proxy together: the embedded default model on port 5000."""
    settings = settings_from_options(values)  # every proxy option checked before anything starts
    check = subprocess.run([*WORKER_CHECK_UNDER_SERVE, *worker_args], check=False)
    if check.returncode != 0:
        raise SystemExit(check.returncode)
    with contextlib.ExitStack() as stack:
        # A directory of its own: two serves never share sockets or heartbeat files.
        private = stack.enter_context(instance_dir())
        heartbeat_file = private / "worker.heartbeat"
        if settings.input_addr is None or settings.output_addr is None:
            din, dout = default_addresses(private)
            settings = dataclasses.replace(
                settings, input_addr=settings.input_addr or din, output_addr=settings.output_addr or dout
            )
        setup_logging(settings.log_level, settings.log_format)
        argv = [
            *WORKER_COMMAND,
            *cli_args(settings, ("input_addr", "output_addr", "log_level", "log_format")),
            "--parent-pid",
            str(os.getpid()),
            "--heartbeat-file",
            str(heartbeat_file),
            *worker_args,
        ]
        from proxy.server.runner import run

        # A worker whose heartbeats stop for as long as the proxy waits before it
        # declares it dead is killed and restarted: nothing else would revive it.
        supervisor = WorkerSupervisor(
            argv, heartbeat_file=heartbeat_file, hung_after=settings.heartbeat_timeout
        )
        try:
            run(_serve(settings, supervisor))
        except OSError as e:
            exit_on_bind_error(settings, e)
        except WorkerNeverServed:
            raise SystemExit(1) from None


async def _serve(settings: ProxySettings, supervisor: WorkerSupervisor) -> None:
    """The proxy until SIGINT/SIGTERM, beside the supervised worker. Raises
    ``WorkerNeverServed`` (after the proxy has closed) when the worker exits before
    it ever served: the load fails the same way each time, so nothing restarts it."""
    from proxy.app import run_proxy
    from proxy.engine.client import ZmqEngineClient

    stop = asyncio.Event()
    supervision = asyncio.create_task(supervisor.run())
    supervision.add_done_callback(lambda _: stop.set())
    try:
        await run_proxy(settings, ZmqEngineClient(settings), stop=stop)
    finally:
        supervision.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await supervision
        logging.getLogger("exl3_sidecar").info("worker stopped")
