"""``exl3-sidecar chat`` shows a reasoning model's thinking apart from its answer:
each API's thinking events read as thinking (never as answer text), the plain
view writes them to stderr (stdout stays the answer), the terminal view dims them."""

from __future__ import annotations

import io
import json

from rich.console import Console

from launcher.chat.apis import ChatReader, MessagesReader, ResponsesReader
from launcher.chat.plain import PlainView
from launcher.chat.terminal import TerminalView


def test_chat_reader_reads_both_field_names() -> None:
    reader = ChatReader()
    for name in ("reasoning_content", "reasoning"):
        chunk = {"choices": [{"index": 0, "delta": {name: "Hm"}, "finish_reason": None}]}
        update = reader.read("message", json.dumps(chunk))
        assert update is not None and update.thinking == "Hm" and update.text is None


def test_responses_reader() -> None:
    reader = ResponsesReader()
    ev = {"type": "response.reasoning_text.delta", "delta": "Hm", "item_id": "rs_1", "output_index": 0}
    update = reader.read("response.reasoning_text.delta", json.dumps(ev))
    assert update is not None and update.thinking == "Hm" and update.text is None


def test_messages_reader() -> None:
    reader = MessagesReader()
    ev = {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Hm"}}
    update = reader.read("content_block_delta", json.dumps(ev))
    assert update is not None and update.thinking == "Hm" and update.text is None
    sig = {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "s"}}
    assert reader.read("content_block_delta", json.dumps(sig)) is None


def test_plain_view_sends_thinking_to_stderr() -> None:
    out, err = io.StringIO(), io.StringIO()
    view = PlainView(out, err)
    view.thinking("Let me")
    view.thinking(" think.")
    view.content("Yes.")
    view.close()
    assert out.getvalue() == "Yes."
    assert err.getvalue() == "Let me think.\n"


def test_terminal_view_dims_thinking_before_the_answer() -> None:
    buffer = io.StringIO()
    out = Console(file=buffer, force_terminal=True, color_system="standard", width=80)
    err = Console(file=io.StringIO(), force_terminal=True, width=80)
    view = TerminalView(out, err, clock=lambda: 0.0)
    view.started()
    view.thinking("Hm")
    view.content("Yes")
    view.close()
    text = buffer.getvalue()
    assert "\x1b[2;3mHm" in text  # dim italic
    plain = text.replace("\x1b[2;3m", "").replace("\x1b[0m", "")
    assert plain.index("Hm") < plain.index("\n\nYes")
