"""JSON text helpers for tool-call parsing: where a JSON value ends in text that
arrives piecewise, compact re-spacing that keeps the model's own tokens, and
decoding a call object ``{"name": str, "arguments" | "parameters": {...}}``.

Arguments are returned as the model wrote them minus insignificant whitespace
(not decoded and re-encoded): numbers, escapes and key order stay exactly as
generated, and huge integers or exotic floats cannot fail a re-encode.
"""

from __future__ import annotations

import re

import msgspec

from proxy.tools.spec import FunctionCall

WHITESPACE = " \t\n\r"
"""JSON's insignificant whitespace (RFC 8259)."""

# Outside strings only these matter to nesting; inside a string only the quote
# and the backslash do. Searching for them skips the rest in C.
_STRUCTURE = re.compile(r'[{}\[\]"]')
_STRING_END = re.compile(r'["\\]')
# A JSON string token (unrolled loop), or a run of whitespace outside strings.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[ \t\n\r]+', re.DOTALL)


def skip_whitespace(text: str, i: int) -> int:
    """The first index at or after ``i`` that is not JSON whitespace."""
    n = len(text)
    while i < n and text[i] in WHITESPACE:
        i += 1
    return i


class JsonSpan:
    """Finds the end of one JSON object or array in a text that grows.

    Start it at the index of the opening ``{`` or ``[``; call ``scan`` with the
    whole text each time more has arrived (the same text, only longer). It
    tracks nesting, strings and escapes, so brackets inside strings do not
    count; it does not validate (the decoder does, once the span is complete).
    Total work is linear in the text length however it is split.
    """

    __slots__ = ("_depth", "_in_string", "_pos")

    def __init__(self, start: int) -> None:
        self._pos = start
        self._depth = 0
        self._in_string = False

    def scan(self, text: str) -> int | None:
        """The index just after the closing bracket, or ``None`` if not there yet."""
        i, n = self._pos, len(text)
        while i < n:
            if self._in_string:
                m = _STRING_END.search(text, i)
                if m is None:
                    i = n
                    break
                j = m.start()
                if text[j] == "\\":
                    if j + 1 >= n:
                        # The escaped character has not arrived: resume at the backslash.
                        i = j
                        break
                    i = j + 2
                    continue
                self._in_string = False
                i = j + 1
                continue
            m = _STRUCTURE.search(text, i)
            if m is None:
                i = n
                break
            j = m.start()
            c = text[j]
            i = j + 1
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    self._pos = i
                    return i
        self._pos = i
        return None


def compact(json_text: str) -> str:
    """``json_text`` (valid JSON) without whitespace outside strings."""
    return _TOKEN.sub(lambda m: m.group() if m.group()[0] == '"' else "", json_text)


class _CallObject(msgspec.Struct):
    # Raw: the arguments' own text, for ``compact``; an empty Raw means absent.
    # Other keys ("id" in Mistral's arrays, "type" in Llama's) are ignored.
    name: str
    arguments: msgspec.Raw = msgspec.Raw()
    parameters: msgspec.Raw = msgspec.Raw()


_check_object = msgspec.json.Decoder(dict[str, object])
_decode_call = msgspec.json.Decoder(_CallObject)
_decode_calls = msgspec.json.Decoder(list[_CallObject])


def _arguments(call: _CallObject) -> str | None:
    given = [raw for raw in (call.arguments, call.parameters) if len(raw)]
    if not given:
        # A function without parameters: models often leave the key out.
        return "{}"
    if len(given) > 1:
        return None  # both "arguments" and "parameters": ambiguous
    text = bytes(given[0]).decode()
    try:
        _check_object.decode(text)
    except msgspec.ValidationError:
        return None  # valid JSON, but not an object
    return compact(text)


def _checked(call: _CallObject, names: frozenset[str]) -> FunctionCall | None:
    if call.name not in names:
        return None
    arguments = _arguments(call)
    return None if arguments is None else FunctionCall(call.name, arguments)


def decode_call(json_text: str, names: frozenset[str]) -> FunctionCall | None:
    """The call in one JSON object ``{"name": str, "arguments" | "parameters":
    {...}}`` (no arguments key: ``{}``), or ``None`` when the text is not valid
    JSON, not that shape, or names a function not in ``names``."""
    try:
        call = _decode_call.decode(json_text)
    except msgspec.DecodeError:  # ValidationError is a DecodeError
        return None
    return _checked(call, names)


def decode_call_array(json_text: str, names: frozenset[str]) -> list[FunctionCall] | None:
    """The calls in a non-empty JSON array of call objects (Mistral's form), or
    ``None`` when any of them is not a valid call (see ``decode_call``)."""
    try:
        calls = _decode_calls.decode(json_text)
    except msgspec.DecodeError:
        return None
    out: list[FunctionCall] = []
    for c in calls:
        checked = _checked(c, names)
        if checked is None:
            return None
        out.append(checked)
    return out or None


def decode_call_arguments(name: str, json_text: str, names: frozenset[str]) -> FunctionCall | None:
    """A call whose name came outside the JSON (Mistral's ``name[ARGS]{...}``):
    ``None`` unless ``name`` is in ``names`` and ``json_text`` is a JSON object."""
    if name not in names:
        return None
    try:
        _check_object.decode(json_text)
    except msgspec.DecodeError:
        return None
    return FunctionCall(name, compact(json_text))


# A call object's start up to its name, then (once written) its arguments key.
_PARTIAL_NAME = re.compile(r'\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*"(?P<name>[^"\\]*)"')
_PARTIAL_ARGS = re.compile(r'[ \t\n\r]*,[ \t\n\r]*"(?:arguments|parameters)"[ \t\n\r]*:[ \t\n\r]*')


def partial_arguments(text: str) -> str:
    """Arguments as far as written: the JSON value at the start of ``text``
    compacted when it is complete, else the text without trailing whitespace
    (not compacted: whitespace inside an unterminated string is the model's)."""
    text = text.lstrip(WHITESPACE)
    if text[:1] in ("{", "["):
        end = JsonSpan(0).scan(text)
        if end is not None:
            try:
                msgspec.json.decode(text[:end])
            except msgspec.DecodeError:
                return text[:end]
            return compact(text[:end])
    return text.rstrip(WHITESPACE)


def partial_call(text: str, names: frozenset[str]) -> FunctionCall | None:
    """The call an unfinished call object was becoming (``text`` starts at its
    ``{``; ``name`` first, as the grammars write it): its name once complete
    and in ``names``, with the arguments as far as written (``""`` before they
    start, see ``partial_arguments``); ``None`` before the name is complete."""
    m = _PARTIAL_NAME.match(text)
    if m is None or m["name"] not in names:
        return None
    a = _PARTIAL_ARGS.match(text, m.end())
    return FunctionCall(m["name"], partial_arguments(text[a.end() :]) if a else "")
