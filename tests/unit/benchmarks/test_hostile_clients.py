"""What the ``stalled`` case of ``benchmarks/hostile_clients.py`` reads off a socket
it never reads from: whether the server ended it, and how much the server's
kernel holds for it (Linux only, like the script)."""

from __future__ import annotations

import fcntl
import socket
import struct
import sys
import termios
import time
from collections.abc import Callable, Iterator

import pytest

from benchmarks.hostile_clients import _server_side, _tcp_state

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="TCP_INFO and /proc/net/tcp are Linux's")


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A loopback connection: (the client's side, with a 4 KiB receive buffer; the server's)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(listener.getsockname())
        server, _ = listener.accept()
    with client, server:
        yield client, server


def _settle(check: Callable[[], object], want: object) -> object:
    """``check()`` once it returns ``want``, or its last value after 2 s."""
    deadline = time.monotonic() + 2.0
    got = check()
    while got != want and time.monotonic() < deadline:
        time.sleep(0.01)
        got = check()
    return got


def test_the_state_tells_open_from_reset_from_closed(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    assert _tcp_state(client) == "open"
    server.shutdown(socket.SHUT_WR)  # FIN
    assert _settle(lambda: _tcp_state(client), "closed (FIN)") == "closed (FIN)"


def test_an_aborted_connection_reads_as_reset(pair: tuple[socket.socket, socket.socket]) -> None:
    client, server = pair
    server.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends RST
    server.close()
    assert _settle(lambda: _tcp_state(client), "reset") == "reset"


def test_the_server_side_holds_what_it_could_not_deliver_also_once_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, server = pair
    assert _server_side(client) == ("ESTABLISHED", 0)
    server.setblocking(False)
    sent = 0
    chunk = b"x" * 65536
    for _ in range(64):  # until the client's 4 KiB window and the server's buffer are full
        try:
            sent += server.send(chunk)
        except BlockingIOError:
            break
    # What sits in the client's receive buffer was delivered: not the server's to hold.
    unread = struct.unpack("i", fcntl.ioctl(client, termios.FIONREAD, b"\0" * 4))[0]
    assert unread > 0
    state, queued = _server_side(client)
    # Unacknowledged bytes: all those the client has not received, and perhaps
    # some it has but not yet acknowledged (a delayed ACK).
    assert state == "ESTABLISHED"
    assert sent - unread <= queued <= sent
    server.close()  # with bytes unsent: the kernel keeps them, and the FIN waits behind them
    state, after = _server_side(client)
    assert state == "FIN_WAIT1"
    assert after >= sent - unread
    assert _tcp_state(client) == "open"  # the client cannot tell
