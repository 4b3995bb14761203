"""The ``exl3-sidecar chat`` command: options, where the prompt comes from, exit status."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import click

from launcher.chat.apis import APIS
from launcher.wait import wait_option

DEFAULT_BASE_URL = "http://127.0.0.1:5000/v1"
"""Where ``exl3-sidecar serve`` listens by default; like the OpenAI SDKs' ``base_url``, it ends in ``/v1``."""

F = TypeVar("F", bound=Callable[..., Any])


def server_options(f: F) -> F:
    """``--base-url`` and ``--port``, for the commands that talk to a server (``chat``;
    ``top`` to come). The command gets ``base_url`` and ``port``; ``base_url_of`` makes one URL."""
    f = click.option(
        "--port",
        type=click.IntRange(1, 65535),
        help="The server's port on this machine: short for --base-url http://127.0.0.1:PORT/v1.",
    )(f)
    f = click.option(
        "--base-url",
        help=f"The server's OpenAI base URL, /v1 included.  [default: {DEFAULT_BASE_URL}]",
    )(f)
    return f


def base_url_of(base_url: str | None, port: int | None) -> str:
    """The URL ``server_options`` stand for; raises ``click.UsageError`` when both are given."""
    if base_url is not None and port is not None:
        raise click.UsageError("give --base-url or --port, not both")
    if port is not None:
        return f"http://127.0.0.1:{port}/v1"
    return base_url or DEFAULT_BASE_URL


EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C


@click.command(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
    short_help="Stream an answer from any OpenAI-compatible server.",
)
@click.argument("prompt", required=False)
@click.option(
    "-f",
    "--file",
    "prompt_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Read the prompt from this file (UTF-8).",
)
@click.option("-s", "--system", help="System message, sent before the prompt.")
@click.option("-m", "--model", help='Model name. Default: the first id from GET /v1/models, else "default".')
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    help="Most tokens to generate (default: the server's; with --api messages, which requires it, 4096).",
)
@click.option(
    "--temperature", type=click.FloatRange(min=0), help="Sampling temperature (default: the server's)."
)
@click.option(
    "--api",
    "api_name",
    type=click.Choice(list(APIS)),
    default="chat",
    show_default=True,
    help="The API to send the prompt through: chat completions (POST /v1/chat/completions), the "
    "Responses API (POST /v1/responses) or Anthropic's Messages (POST /v1/messages).",
)
@click.option(
    "--api-key",
    help="Sent as 'Authorization: Bearer KEY' (with --api messages: 'x-api-key: KEY'). Default: "
    "$EXL3_SIDECAR_API_KEY (its first key), else $OPENAI_API_KEY ($ANTHROPIC_API_KEY with --api "
    "messages). Prefer the variables: a command line shows up in ps.",
)
@server_options
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=600.0,
    show_default=True,
    help="Seconds the server may send nothing before the client gives up.",
)
@click.option("--plain", is_flag=True, help="Plain lines even on a terminal.")
@wait_option
def chat(
    prompt: str | None,
    prompt_file: Path | None,
    system: str | None,
    model: str | None,
    max_tokens: int | None,
    temperature: float | None,
    api_name: str,
    api_key: str | None,
    base_url: str | None,
    port: int | None,
    timeout: float,
    plain: bool,
    wait_s: float,
) -> None:
    """Send a prompt to any OpenAI-compatible server and stream the answer.

    A server still loading its model (this one's GET /ready says so) is waited for,
    a line per load stage, up to --wait seconds.

    The prompt is PROMPT, the file given with --file, or stdin (no PROMPT, or -). While
    the request waits in the server's queue and while the prompt is prefilled, it shows
    the queue position and the prefill progress, when the server sends them (this
    server does, in each of the three APIs; llama.cpp's sends prefill progress with
    chat). Then the answer, then the usage: prompt tokens and the cached share,
    completion tokens, draft acceptance, time to first token and decode speed.

    The answer goes to stdout and nothing else does; progress, usage and errors go to
    stderr. When stdout and stderr are both a terminal, progress is drawn live;
    otherwise (or with --plain) all of it is plain lines, without escape codes.

    Exit status: 0 done, 1 error (the server's message is shown), 2 bad usage, 130
    interrupted (Ctrl-C closes the stream, which makes the server stop the work).
    """
    code = 0
    url = base_url_of(base_url, port)
    try:
        text = _read_prompt(prompt, prompt_file)
        key = api_key or _env_api_key(api_name)
        args = (text, system, model, max_tokens, temperature, api_name, key, url, timeout, plain, wait_s)
        with _interrupt_for_sure():
            code = _chat(*args)
    except BrokenPipeError:
        # The reader of stdout went away (| head): stop quietly; the stream was closed on the way out.
        _silence_stdout()
        code = EXIT_ERROR
    except KeyboardInterrupt:  # Ctrl-C before the request: nothing to close
        code = EXIT_INTERRUPTED
    if code:
        raise SystemExit(code)


INTERRUPT_GRACE_S = 5.0
"""How long a Ctrl-C may take to unwind before the process ends anyway."""


@contextlib.contextmanager
def _interrupt_for_sure() -> Iterator[None]:
    """Ctrl-C raises ``KeyboardInterrupt`` as usual, and also arms a timer that ends
    the process with 130 if it is still running ``INTERRUPT_GRACE_S`` later: an
    interrupt that lands in a ``__del__`` or a garbage-collector callback is printed
    and swallowed by Python, and the stream would then wait on a silent server (seen
    once in CI under load). Exiting closes the socket, which stops the server's work
    just as closing the stream does."""
    import signal
    import threading

    def on_sigint(signum: int, frame: object) -> None:
        def give_up() -> None:
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write("error: interrupted\n")
                sys.stderr.flush()
            os._exit(EXIT_INTERRUPTED)

        timer = threading.Timer(INTERRUPT_GRACE_S, give_up)
        timer.daemon = True
        timer.start()
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGINT, on_sigint)
    except ValueError:  # not the main thread: Python's own handling stays
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _chat(
    text: str,
    system: str | None,
    model: str | None,
    max_tokens: int | None,
    temperature: float | None,
    api_name: str,
    api_key: str | None,
    base_url: str,
    timeout: float,
    plain: bool,
    wait_s: float = 0.0,
) -> int:
    # Imported here, not at the top: `exl3-sidecar serve` and `proxy` load this module to
    # register the command and never need the HTTP client or rich.
    from launcher.chat.apis import ChatRequest
    from launcher.chat.client import ChatError, first_model_id, open_client
    from launcher.chat.session import View, run_turn

    api = APIS[api_name]
    view: View
    if plain or not _is_terminal():
        from launcher.chat.plain import PlainView

        view = PlainView(sys.stdout, sys.stderr)
    else:
        from rich.console import Console

        from launcher.chat.terminal import TerminalView

        view = TerminalView(Console(), Console(stderr=True))
    try:
        with open_client(base_url, api.headers(api_key), timeout) as client:
            if wait_s > 0:
                from launcher.wait import wait_until_ready

                wait_until_ready(client, lambda line: click.echo(line, err=True), within=wait_s)
            request = ChatRequest(model or first_model_id(client), text, system, max_tokens, temperature)
            run_turn(client, api, request, view)
    except ChatError as e:
        view.failed(str(e))
        return EXIT_ERROR
    except KeyboardInterrupt:
        view.failed("interrupted")
        return EXIT_INTERRUPTED
    finally:
        view.close()
    return 0


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("give the prompt as PROMPT or with --file, not both")
    if prompt_file is not None:
        try:
            text = prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise click.UsageError(f"cannot read --file {prompt_file}: {e}") from e
    elif prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise click.UsageError("no prompt: give PROMPT, --file PATH, or pipe it on stdin")
        text = sys.stdin.read()
    else:
        return prompt
    # `echo hi | exl3-sidecar chat` means "hi": the newline that ends the file is not part of the prompt.
    text = text.rstrip("\r\n")
    if not text.strip():
        raise click.UsageError("the prompt is empty")
    return text


def _env_api_key(api_name: str) -> str | None:
    # The server reads EXL3_SIDECAR_API_KEY as a comma-separated list of accepted keys; a client sends one.
    keys = [k.strip() for k in os.environ.get("EXL3_SIDECAR_API_KEY", "").split(",")]
    vendor = "ANTHROPIC_API_KEY" if api_name == "messages" else "OPENAI_API_KEY"
    return next((k for k in keys if k), None) or os.environ.get(vendor) or None


def _is_terminal() -> bool:
    # Both streams: a live display on stderr while stdout goes to a file would mix escape
    # codes into a log as often as not, and plain lines lose nothing there.
    return sys.stdout.isatty() and sys.stderr.isatty() and os.environ.get("TERM") != "dumb"


def _silence_stdout() -> None:
    # Python flushes stdout at exit and would report the broken pipe again.
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
