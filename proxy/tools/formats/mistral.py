"""``mistral`` (Mistral 7B v0.3, Nemo, Small; ``[TOOL_CALLS]`` is a control token)::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}       (tokenizer v11 and later)
    [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{...}

a JSON array of calls, or (newer templates) the name then ``[ARGS]`` then the
arguments object, repeated with ``[TOOL_CALLS]`` per call. Sources:
``mistral-common``'s tokenizer versions; vLLM's ``mistral`` parser; llama.cpp's
Mistral Nemo and Ministral/Magistral handlers. Mistral templates reject tool
call ids that are not 9 alphanumeric characters, so this format's ids are
those, not ``call_...``.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

from proxy.tools.formats.base import (
    BlockOutcome,
    BlockProgress,
    CallBlock,
    StreamingCall,
    ToolCallFormat,
    Tools,
    call_object,
    mistral_call_id,
    not_a_call,
    wait_or_fail,
)
from proxy.tools.formats.objects import CallObjectStream
from proxy.tools.jsontext import (
    JsonPrefix,
    JsonSpan,
    decode_call_arguments,
    decode_call_array,
    skip_whitespace,
)
from proxy.tools.spec import FunctionCall

NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")
"""Characters of a function name (``spec.NAME_PATTERN``)."""
_ARGS = "[ARGS]"
_CALL_ID = "[CALL_ID]"


class _Array:
    """The calls of a ``[...]`` array as they are written, one ``CallObjectStream``
    each, the next one begun once the one before has closed and a ``,`` came."""

    def __init__(self, start: int, tools: Tools) -> None:
        self._tools = tools
        self._objects: list[CallObjectStream] = []
        self._wrapper = JsonSpan(start)
        self._next = start + 1  # where the next object's "{" may come
        self._after = -1  # where the last object closed, while a "," is awaited
        self._valid_end = start + 1
        self._done = False

    def _step(self, body: str) -> bool:
        """One step further through the array; False to wait or stop."""
        if self._after >= 0:  # between objects
            k = skip_whitespace(body, self._after)
            if k == len(body):
                return False
            self._done = body[k] != ","
            self._after, self._next = -1, k + 1
            return not self._done
        if not self._objects or self._objects[-1].start < self._next:
            i = skip_whitespace(body, self._next)
            if i == len(body):
                return False
            if body[i] != "{":
                self._done = True
                return False
            self._objects.append(CallObjectStream(i, self._tools))
            self._wrapper = JsonSpan(i)
        obj = self._objects[-1]
        obj.scan(body)
        if obj.call is None:
            return False
        self._valid_end = obj.valid_end
        if obj.arguments is None or obj.arguments.end is None:
            return False
        end = self._wrapper.scan(body)
        if end is None:
            return False
        self._valid_end = self._after = end
        return True

    def progress(self, body: str) -> BlockProgress:
        while not self._done and self._step(body):
            pass
        calls = [o.call for o in self._objects if o.call is not None]
        return BlockProgress(calls, self._valid_end)


class _MistralBlock:
    """After ``[TOOL_CALLS]``: a JSON array of calls, or ``name[ARGS]{...}``
    (optionally ``name[CALL_ID]id[ARGS]{...}``)."""

    def __init__(self, tools: Tools) -> None:
        self._tools = tools
        self._span: JsonSpan | None = None
        self._start = -1
        self._name = ""
        self._array: _Array | None = None
        self._arguments: JsonPrefix | None = None
        self._call: StreamingCall | None = None

    def _scan_named(self, body: str, i: int, final: bool) -> BlockOutcome | None:
        # Up to the arguments' "{": the name, then [ARGS] or [CALL_ID]id[ARGS].
        # Sets the span once the "{" is there; until then waits or refuses.
        j = i
        while j < len(body) and body[j] in NAME_CHARS:
            j += 1
        if j - i > 64:
            return not_a_call(0)
        rest = body[j:]
        if rest.startswith(_CALL_ID):
            k = j + len(_CALL_ID)
            while k < len(body) and body[k] in NAME_CHARS:
                k += 1
            after = body[k:]
            if after.startswith(_ARGS):
                args_at = k + len(_ARGS)
            elif _ARGS.startswith(after):
                return wait_or_fail(body, final)
            else:
                return not_a_call(0)
        elif rest.startswith(_ARGS):
            args_at = j + len(_ARGS)
        elif _ARGS.startswith(rest) or _CALL_ID.startswith(rest):
            return wait_or_fail(body, final)
        else:
            return not_a_call(0)
        a = skip_whitespace(body, args_at)
        if a == len(body):
            return wait_or_fail(body, final)
        if body[a] != "{":
            return not_a_call(0)
        self._name = body[i:j]
        self._start = a
        self._span = JsonSpan(a)
        return None

    def advance(self, body: str, final: bool) -> BlockOutcome | None:
        if self._span is None:
            i = skip_whitespace(body, 0)
            if i == len(body):
                return wait_or_fail(body, final)
            if body[i] == "[":
                self._start = i
                self._span = JsonSpan(i)
            elif body[i] in NAME_CHARS:
                outcome = self._scan_named(body, i, final)
                if self._span is None:  # the arguments have not started (or never will)
                    return outcome
            else:
                return not_a_call(0)
        assert self._span is not None
        end = self._span.scan(body)
        if end is None:
            return wait_or_fail(body, final)
        text = body[self._start : end]
        if self._name:
            call = decode_call_arguments(self._name, text, self._tools)
            return BlockOutcome(end, None if call is None else [call])
        return BlockOutcome(end, decode_call_array(text, self._tools))

    def progress(self, body: str) -> BlockProgress:
        if self._span is None:
            return BlockProgress((), 0)
        if not self._name:
            if self._array is None:
                self._array = _Array(self._start, self._tools)
            return self._array.progress(body)
        if self._name not in self._tools:
            return BlockProgress((), 0)
        if self._arguments is None:
            self._arguments = JsonPrefix(self._start)
            self._call = StreamingCall(self._name, self._arguments)
        assert self._call is not None
        args = self._arguments
        args.scan(body)
        return BlockProgress((self._call,), args.end if args.end is not None else args.final_end)


def _block(marker: str, tools: Tools) -> CallBlock:
    return _MistralBlock(tools)


def _render(calls: Sequence[FunctionCall]) -> str:
    return "[TOOL_CALLS][" + ", ".join(call_object(c.name, c.arguments, "arguments") for c in calls) + "]"


MISTRAL = ToolCallFormat(
    name="mistral",
    markers=("[TOOL_CALLS]",),
    open_block=_block,
    matches_template=lambda source: "[TOOL_CALLS]" in source,
    render_calls=_render,
    syntax_hint='[TOOL_CALLS][{"name": <function-name>, "arguments": <arguments-json-object>}]',
    new_call_id=mistral_call_id,
    grammar_open=("[TOOL_CALLS]", "["),
    grammar_joiner=(", ",),
    grammar_close=("]",),
)
