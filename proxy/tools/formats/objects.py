"""Call objects in JSON, ``{"name": NAME, "arguments" | "parameters": {...}}``,
as Hermes, Llama 3 and Mistral's arrays write them: a block holding one
(``JsonObjectBlock``), and the stream of one as it is written
(``CallObjectStream``), which the blocks of several share.

Streaming starts when the object's text begins ``{"name": "NAME", "arguments":
{`` (the name first, as the grammars and the published templates write it) and
NAME is callable; an object written in another key order is decided whole.
"""

from __future__ import annotations

import re

from proxy.tools.formats.base import (
    BlockOutcome,
    BlockProgress,
    StreamingCall,
    Tools,
    not_a_call,
    wait_or_fail,
)
from proxy.tools.jsontext import JsonPrefix, JsonSpan, decode_call, skip_whitespace

# A call object's start up to its name, then its arguments key.
_NAME = re.compile(r'\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*"(?P<name>[^"\\]*)"')
_ARGUMENTS_KEY = re.compile(r'[ \t\n\r]*,[ \t\n\r]*"(?:arguments|parameters)"[ \t\n\r]*:[ \t\n\r]*')
# Characters from the "{" within which the name and the arguments key must have
# come for the object to stream: a function name is at most 64 characters.
_HEAD_LIMIT = 256


class CallObjectStream:
    """One call object from its ``{`` at ``start``, streamed as it is written:
    ``call`` once the name is complete and callable, its arguments a
    ``JsonPrefix`` once their ``{`` is there. ``scan`` with the growing text."""

    __slots__ = ("_after_name", "_given_up", "_tools", "arguments", "call", "start")

    def __init__(self, start: int, tools: Tools) -> None:
        self.start = start
        self.call: StreamingCall | None = None
        self.arguments: JsonPrefix | None = None
        self._tools = tools
        self._after_name = -1
        self._given_up = False

    def scan(self, body: str) -> None:
        """Reads what has arrived (the same text, only longer)."""
        if self.arguments is not None:
            self.arguments.scan(body)
            return
        if self._given_up:
            return
        over = len(body) - self.start > _HEAD_LIMIT
        if self.call is None:
            m = _NAME.match(body, self.start)
            if m is None:
                self._given_up = over
                return
            if m["name"] not in self._tools:
                self._given_up = True
                return
            self.call = StreamingCall(m["name"])
            self._after_name = m.end()
        a = _ARGUMENTS_KEY.match(body, self._after_name)
        if a is None or a.end() == len(body):
            self._given_up = over
            return
        if body[a.end()] != "{":
            self._given_up = True
            return
        self.arguments = JsonPrefix(a.end())
        self.call.arguments = self.arguments
        self.arguments.scan(body)

    @property
    def valid_end(self) -> int:
        """The index up to which the text belongs to the call as streamed."""
        if self.arguments is None:
            return self.start
        return self.arguments.end if self.arguments.end is not None else self.arguments.final_end


class JsonObjectBlock:
    """Whitespace, one JSON call object, then (``end_tag``) whitespace and the tag.

    The object is a call of one of ``tools`` (``decode_call``) or none. ``first_keys``
    limits which first key makes the object a call attempt at all (checked as
    soon as it is known, so that a JSON answer is not held back to its end).
    """

    def __init__(
        self,
        tools: Tools,
        end_tag: str = "",
        first_keys: frozenset[str] | None = None,
    ) -> None:
        self._tools = tools
        self._end_tag = end_tag
        self._first_keys = first_keys
        self._start = -1
        self._span: JsonSpan | None = None
        self._end = -1
        self._stream: CallObjectStream | None = None

    def _first_key_ok(self, body: str) -> bool | None:
        assert self._first_keys is not None
        i = skip_whitespace(body, self._start + 1)
        if i == len(body):
            return None
        if body[i] != '"':
            return False
        close = body.find('"', i + 1)
        if close < 0:
            # The keys allowed are short: an unclosed one past 16 characters is none of them.
            return None if len(body) - i <= 16 else False
        return body[i + 1 : close] in self._first_keys

    def advance(self, body: str, final: bool) -> BlockOutcome | None:
        if self._span is None:
            i = skip_whitespace(body, 0)
            if i == len(body):
                return wait_or_fail(body, final)
            if body[i] != "{":
                return not_a_call(0)
            self._start = i
            self._span = JsonSpan(i)
        if self._end < 0:
            if self._first_keys is not None:
                ok = self._first_key_ok(body)
                if ok is False:
                    return not_a_call(0)
                if ok is None:
                    return wait_or_fail(body, final)
                self._first_keys = None
            end = self._span.scan(body)
            if end is None:
                return wait_or_fail(body, final)
            self._end = end
        if not self._end_tag:
            call = decode_call(body[self._start : self._end], self._tools)
            return BlockOutcome(self._end, None if call is None else [call])
        k = skip_whitespace(body, self._end)
        tail = body[k:]
        if tail.startswith(self._end_tag):
            call = decode_call(body[self._start : self._end], self._tools)
            return BlockOutcome(k + len(self._end_tag), None if call is None else [call])
        if not final and self._end_tag.startswith(tail):
            return None
        # The object is not followed by the closing tag: not a call.
        return not_a_call(self._end)

    def progress(self, body: str) -> BlockProgress:
        if self._start < 0 or self._first_keys is not None:
            return BlockProgress((), 0)  # no object yet, or not known to be a call attempt
        if self._stream is None:
            self._stream = CallObjectStream(self._start, self._tools)
        stream = self._stream
        stream.scan(body)
        calls = () if stream.call is None else (stream.call,)
        done = stream.arguments is not None and stream.arguments.end is not None
        # Once the object has closed, its "}" is the call's too.
        return BlockProgress(calls, self._end if done and self._end >= 0 else stream.valid_end)
