"""The terminal view renders the scripted stream without crashing: with rich forced
into terminal mode on a buffer, and through the real command on a pseudo-terminal."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
from typing import Any

import pytest
from rich.console import Console

from launcher.chat.apis import APIS, ChatRequest
from launcher.chat.client import open_client
from launcher.chat.session import run_turn
from launcher.chat.stats import Prefill
from launcher.chat.terminal import TerminalView, prefill_bar
from launcher.chat.wire import PromptProgress, QueueProgress
from tests.unit.launcher.test_chat import (  # clean_environment: the autouse fixture, here too
    CACHE,
    PIECES,
    TOTAL,
    USAGE,
    clean_environment,  # noqa: F401
    full_script,
    script,
    serve,
)


def test_the_bar_shows_the_cached_part_apart() -> None:
    p = Prefill.of(PromptProgress(total=100, cache=25, processed=50, time_ms=10))
    bar = prefill_bar(p, 20)
    assert bar.plain == "━" * 20
    cells = [(span.start, span.end, str(span.style)) for span in bar.spans]
    assert cells == [(0, 5, "cyan"), (5, 10, "green"), (10, 20, "grey37")]


async def test_rich_terminal_view_renders_a_whole_turn(aiohttp_server: Any) -> None:
    server = await serve(aiohttp_server, full_script())
    out, err = io.StringIO(), io.StringIO()
    view = TerminalView(
        Console(file=out, force_terminal=True, width=100, color_system="truecolor"),
        Console(file=err, force_terminal=True, width=100, color_system="truecolor"),
    )

    def turn() -> None:
        with open_client(server.base_url, {}, 30) as client:
            try:
                run_turn(client, APIS["chat"], ChatRequest("m", "hi"), view)
            finally:
                view.close()

    await asyncio.to_thread(turn)
    assert out.getvalue() == "".join(PIECES) + "\n"
    status = err.getvalue()
    assert "\x1b[" in status
    assert f"prefill {TOTAL}/{TOTAL} tokens (cached {CACHE})" in status
    assert f"usage: prompt {USAGE['prompt_tokens']} (cached {CACHE}" in status


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_spinner_turns_while_waiting_and_queued() -> None:
    # rich draws a spinner's frame from the time since its first frame: the live line must keep
    # one spinner, not make a new one (forever at its first frame) at each refresh.
    err_time = Clock()
    err = Console(file=io.StringIO(), force_terminal=True, width=100, get_time=err_time)
    view = TerminalView(Console(file=io.StringIO()), err)

    def frames() -> list[str]:
        seen = []
        for _ in range(10):
            err_time.now += 0.08  # the "dots" spinner's frame interval
            with err.capture() as capture:
                err.print(view.live_line())
            seen.append(capture.get().split()[0])
        return seen

    assert len(set(frames())) >= 5  # waiting for the server: it turns
    view.queued(QueueProgress(position=1, queued=1, time_ms=0))
    queued = frames()
    assert len(set(queued)) >= 5
    with err.capture() as capture:
        err.print(view.live_line())
    assert "queued: position 1 of 1" in capture.get()


@pytest.mark.parametrize("api", list(APIS))
async def test_the_command_on_a_pseudo_terminal(aiohttp_server: Any, api: str) -> None:
    server = await serve(aiohttp_server, script(api))
    primary, secondary = os.openpty()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "launcher",
            "chat",
            "--base-url",
            server.base_url,
            "--api",
            api,
            "hi",
            stdin=subprocess.DEVNULL,
            stdout=secondary,
            stderr=secondary,
            env=os.environ | {"TERM": "xterm-256color", "COLUMNS": "100"},
        )
        os.close(secondary)
        secondary = -1
        screen = await asyncio.to_thread(_read_all, primary)
        assert await asyncio.wait_for(proc.wait(), 60) == 0, screen
    finally:
        os.close(primary)
        if secondary >= 0:
            os.close(secondary)
    text = screen.decode(errors="replace")
    assert "\x1b[" in text  # drawn live, not plain lines
    assert "".join(PIECES) in text and "Traceback" not in text
    # The lasting lines: the wait and prefill summed up, then the usage.
    assert f"prefill {TOTAL}/{TOTAL} tokens (cached {CACHE})" in text
    assert f"usage: prompt {TOTAL} (cached {CACHE}, " in text


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO once the child's side is closed (Linux)
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def test_the_wait_is_timed_from_sending_not_from_the_servers_receipt() -> None:
    # The server's time_ms starts when its worker took the request; the user has waited since
    # the request left. The live count goes on from "waiting for the server", never back.
    clock = Clock()
    err_file = io.StringIO()
    err = Console(file=err_file, force_terminal=False, width=200)
    view = TerminalView(Console(file=io.StringIO()), err, clock)
    view.started()
    try:
        clock.now = 2.0
        view.queued(QueueProgress(position=1, queued=1, time_ms=900))
        with err.capture() as capture:
            err.print(view.live_line())
        assert "queued: position 1 of 1, waited 2.0 s" in capture.get()
        clock.now = 5.0
        view.prefill(Prefill.of(PromptProgress(total=10, cache=0, processed=0, time_ms=0)))
        clock.now = 6.0
        view.prefill(Prefill.of(PromptProgress(total=10, cache=0, processed=10, time_ms=1000)))
        view.content("x")
    finally:
        view.close()
    assert "queued 5.0 s · prefill 10/10 tokens (cached 0), 10 tok/s, in 1.00 s" in err_file.getvalue()
