"""``harmony`` (GPT-OSS: OpenAI's Harmony messages, whose header names a recipient)::

  <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

one call per turn (``<|call|>`` ends it: the model's EOS, never in the text);
the recipient may be written in the role part instead
(``<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>``).
The worker's Harmony splitter (``engine_worker.reasoning.gpt_oss``) swallows every
other message's header, and sends a call message's whole frame (``<|start|>``, role,
``<|channel|>``, header, ``<|message|>``) and its arguments as content, so this
format reads only calls; a call written on the ``analysis`` channel (in the
thinking) is a call too. Sources: ``openai/harmony``'s ``docs/format.md``
("Function calling", "Receiving tool calls"); vLLM's ``openai`` tool parser for
GPT-OSS (calls are messages whose recipient starts with ``functions.``); llama.cpp's
GPT-OSS handler (either placement of ``to=``). Forced calls (``tool_choice``
``required`` or named) have no grammar pieces in this format yet.
"""

from __future__ import annotations

from collections.abc import Sequence

from proxy.tools.formats.base import (
    BlockOutcome,
    BlockProgress,
    CallBlock,
    StreamingCall,
    ToolCallFormat,
    Tools,
    arguments_json,
    not_a_call,
    wait_or_fail,
)
from proxy.tools.formats.mistral import NAME_CHARS
from proxy.tools.jsontext import JsonPrefix, JsonSpan, decode_call_arguments, skip_whitespace
from proxy.tools.spec import FunctionCall

_MESSAGE = "<|message|>"
_CALL_END = "<|call|>"
_RECIPIENT = "to=functions."
_MAX_FRAME = 256  # header characters before a frame without <|message|> is given up as text


class _HarmonyBlock:
    """After a Harmony frame's first marker (``<|start|>``, ``<|channel|>``, or
    ``" to=functions."`` where the output starts with the role's recipient): the rest of
    the header up to ``<|message|>``, whose recipient names the function, then the
    arguments object and an optional ``<|call|>``."""

    def __init__(self, marker: str, tools: Tools) -> None:
        self._marker = marker
        self._tools = tools
        self._name: str | None = None
        self._args = -1  # index of the arguments' "{" in the body
        self._span: JsonSpan | None = None
        self._end = -1  # just past the arguments object, once scanned (JsonSpan scans once)
        self._arguments: JsonPrefix | None = None
        self._call: StreamingCall | None = None

    def _header(self, body: str, final: bool) -> BlockOutcome | None:
        i = body.find(_MESSAGE)
        if i < 0:
            too_long = len(body) > _MAX_FRAME
            return not_a_call(0) if too_long or final else None
        header = self._marker + body[:i]
        at = header.find(_RECIPIENT)
        if at < 0:
            return not_a_call(0)
        j = at + len(_RECIPIENT)
        k = j
        while k < len(header) and header[k] in NAME_CHARS:
            k += 1
        self._name = header[j:k]
        a = skip_whitespace(body, i + len(_MESSAGE))
        if a == len(body):
            self._args = a
            return wait_or_fail(body, final)
        if body[a] != "{":
            return not_a_call(0)
        self._args = a
        self._span = JsonSpan(a)
        return None

    def advance(self, body: str, final: bool) -> BlockOutcome | None:
        if self._span is None:
            outcome = self._header(body, final)
            if self._span is None:
                return outcome
        assert self._span is not None and self._name is not None
        if self._end < 0:
            end = self._span.scan(body)
            if end is None:
                return wait_or_fail(body, final)
            self._end = end
        end = self._end
        call = decode_call_arguments(self._name, body[self._args : end], self._tools)
        if call is None:
            return not_a_call(0)
        k = skip_whitespace(body, end)
        if body.startswith(_CALL_END, k):
            return BlockOutcome(k + len(_CALL_END), [call])
        if not final and _CALL_END.startswith(body[k:]):
            return None  # <|call|> may follow (it is text only where the engine shows it)
        return BlockOutcome(end, [call])

    def progress(self, body: str) -> BlockProgress:
        if self._span is None or self._name is None or self._name not in self._tools:
            return BlockProgress((), 0)
        if self._arguments is None:
            self._arguments = JsonPrefix(self._args)
            self._call = StreamingCall(self._name, self._arguments)
        assert self._call is not None
        args = self._arguments
        args.scan(body)
        return BlockProgress((self._call,), args.end if args.end is not None else args.final_end)


def _block(marker: str, tools: Tools) -> CallBlock:
    return _HarmonyBlock(marker, tools)


def _render(calls: Sequence[FunctionCall]) -> str:
    return "".join(
        f"<|start|>assistant<|channel|>commentary {_RECIPIENT}{c.name} <|constrain|>json"
        f"{_MESSAGE}{arguments_json(c.arguments)}{_CALL_END}"
        for c in calls
    )


HARMONY = ToolCallFormat(
    name="harmony",
    markers=("<|start|>", "<|channel|>", " " + _RECIPIENT),
    open_block=_block,
    # The template renders history calls in the frame and ends them with <|call|>.
    matches_template=lambda source: "<|channel|>" in source and _CALL_END in source,
    render_calls=_render,
    syntax_hint=(
        f"<|channel|>commentary {_RECIPIENT}<function-name> <|constrain|>json{_MESSAGE}"
        f"<arguments-json-object>{_CALL_END}"
    ),
    grammar_calls=False,
)
