"""``launcher.wait``: ``chat`` and ``top`` wait for a server that is still loading,
a line per stage, within a bound; anything else goes on at once."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from launcher.wait import CONNECT_GRACE_S, ready_url, wait_until_ready


def loading(stage: str, label: str, done: int = 0, total: int = 0, load_s: float = 1.0) -> httpx.Response:
    body = {"stage": stage, "label": label, "done": done, "total": total, "elapsed_s": 0.5, "load_s": load_s}
    return httpx.Response(503, json={"status": "loading", "loading": body})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def client_of(answers: Iterator[httpx.Response | Exception], asked: list[str]) -> httpx.Client:
    def handle(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return httpx.Client(base_url="http://127.0.0.1:5000/v1/", transport=httpx.MockTransport(handle))


def test_the_ready_url_is_at_the_servers_root() -> None:
    assert ready_url("http://127.0.0.1:5000/v1") == "http://127.0.0.1:5000/ready"
    assert ready_url("http://h:1/v1/") == "http://h:1/ready"
    assert ready_url("http://h:1") == "http://h:1/ready"


def test_a_loading_server_is_waited_for_with_a_line_per_stage() -> None:
    answers = iter(
        [
            httpx.ConnectError("refused"),
            httpx.Response(503, json={"status": "not_ready"}),
            loading("import", "import torch and transformers", load_s=1.0),
            loading("import", "import torch and transformers", load_s=2.0),
            loading("quantize", "quantize weights (int4)", 4, 30, load_s=9.25),
            loading("quantize", "quantize weights (int4)", 20, 30, load_s=10.0),
            httpx.Response(200, json={"status": "ready"}),
        ]
    )
    asked: list[str] = []
    said: list[str] = []
    clock = Clock()
    with client_of(answers, asked) as client:
        assert wait_until_ready(client, said.append, within=60, clock=clock, sleep=clock.sleep)
    assert said == [
        "waiting for the server to listen",
        "waiting for the server's engine worker to start",
        "waiting for the server: import torch and transformers, 1.0 s into its start",
        "waiting for the server: quantize weights (int4) (4/30), 9.2 s into its start",
    ]
    assert set(asked) == {"http://127.0.0.1:5000/ready"} and len(asked) == 7


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(200, json={"status": "ready"}),
        httpx.Response(404, text="Not Found"),  # llama.cpp's, vLLM's servers: no /ready
        httpx.Response(503, json={"status": "draining"}),
        httpx.Response(503, text="<html>a gateway</html>"),
    ],
)
def test_anything_but_this_servers_loading_goes_on_at_once(answer: httpx.Response) -> None:
    said: list[str] = []
    with client_of(iter([answer]), []) as client:
        assert not wait_until_ready(client, said.append, within=60)
    assert said == []


def test_the_wait_is_bounded() -> None:
    clock = Clock()
    said: list[str] = []
    forever = iter(lambda: loading("convert", "convert the GGUF"), None)
    with client_of(forever, []) as client:
        assert wait_until_ready(client, said.append, within=5, clock=clock, sleep=clock.sleep)
    assert said[-1] == "gave up waiting after 5 s (--wait)" and clock.now == 5.0


def test_a_refused_connection_is_retried_only_briefly() -> None:
    clock = Clock()
    said: list[str] = []
    refused = iter(lambda: httpx.ConnectError("refused"), None)
    with client_of(refused, []) as client:
        assert wait_until_ready(client, said.append, within=300, clock=clock, sleep=clock.sleep)
    assert said == ["waiting for the server to listen"] and clock.now == CONNECT_GRACE_S
