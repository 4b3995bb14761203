"""JSON text helpers for tool-call parsing: where a JSON value ends in text that
arrives piecewise, compact re-spacing that keeps the model's own tokens, and
decoding a call object ``{"name": str, "arguments" | "parameters": {...}}``.

Arguments are returned as the model wrote them minus insignificant whitespace
(not decoded and re-encoded): numbers, escapes and key order stay exactly as
generated, and huge integers or exotic floats cannot fail a re-encode.
"""

from __future__ import annotations

import re
from collections.abc import Container

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


def _checked(call: _CallObject, names: Container[str]) -> FunctionCall | None:
    if call.name not in names:
        return None
    arguments = _arguments(call)
    return None if arguments is None else FunctionCall(call.name, arguments)


def decode_call(json_text: str, names: Container[str]) -> FunctionCall | None:
    """The call in one JSON object ``{"name": str, "arguments" | "parameters":
    {...}}`` (no arguments key: ``{}``), or ``None`` when the text is not valid
    JSON, not that shape, or names a function not in ``names``."""
    try:
        call = _decode_call.decode(json_text)
    except msgspec.DecodeError:  # ValidationError is a DecodeError
        return None
    return _checked(call, names)


def decode_call_array(json_text: str, names: Container[str]) -> list[FunctionCall] | None:
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


def decode_call_arguments(name: str, json_text: str, names: Container[str]) -> FunctionCall | None:
    """A call whose name came outside the JSON (Mistral's ``name[ARGS]{...}``):
    ``None`` unless ``name`` is in ``names`` and ``json_text`` is a JSON object."""
    if name not in names:
        return None
    try:
        _check_object.decode(json_text)
    except msgspec.DecodeError:
        return None
    return FunctionCall(name, compact(json_text))


# ---------------------------------------------------------------- a value as it is written

# Inside a string: what ends a run of plain characters.
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_SIMPLE_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")
_LOW_SURROGATE = re.compile(r"\\u[dD][c-fC-F][0-9a-fA-F]{2}")

# What the scanner expects next, outside strings.
_VALUE, _VALUE_OR_CLOSE, _KEY_OR_CLOSE, _KEY, _COLON, _AFTER = range(6)
# Inside a token.
_STRING, _NUMBER_TOKEN, _LITERAL = range(6, 9)


class JsonPrefix:
    """One JSON value read as its text grows, written out compact as far as it
    can no longer change: what a tool call's arguments stream as.

    Start it at the value's first character; call ``scan`` with the whole text
    each time more has arrived (the same text, only longer). ``parts`` gathers
    the value's compact text (``compact``'s: no whitespace outside strings) in
    pieces that are final: string contents as they arrive, structure as it is
    read. Held in ``pending`` (written, not final): an unfinished number (``12``
    may become ``123``), ``true``/``false``/``null`` literal, or escape (``\\``,
    ``\\u00``, a high surrogate waiting for its low half), so that every prefix
    of ``parts`` joined is a prefix of valid JSON a partial-JSON reader (the
    Anthropic SDK's) takes. ``end``: the index just past the value once it is
    complete; ``failed``: the text stopped being a prefix of one JSON value
    (RFC 8259: a bad token, an unescaped control character in a string, a
    missing colon), and then ``final_end`` is where the offending token starts.
    ``final_end`` is always the index up to which the text is in ``parts``.
    Total work is linear in the text's length however it is split.
    """

    __slots__ = (
        "_key",
        "_pending_text",
        "_pos",
        "_stack",
        "_state",
        "_token",
        "end",
        "failed",
        "final_end",
        "parts",
    )

    def __init__(self, start: int) -> None:
        self.parts: list[str] = []
        self.end: int | None = None
        self.failed = False
        self.final_end = start
        self._pos = start
        self._stack: list[str] = []
        self._state = _VALUE
        self._key = False  # the string being read is an object key
        self._token = start  # where the number or literal being read starts
        self._pending_text = ""

    @property
    def pending(self) -> str:
        """Compact text written after ``parts`` that is not final yet (see the class)."""
        return self._pending_text

    def text(self) -> str:
        """``parts`` joined."""
        return "".join(self.parts)

    def _fail(self, at: int) -> None:
        self.failed = True
        self.final_end = at
        self._pending_text = ""

    def _close(self, c: str, i: int) -> None:
        self._stack.pop()
        self.parts.append(c)
        self._state = _AFTER
        if not self._stack:
            self.end = i + 1

    def _value_start(self, text: str, i: int) -> bool:
        """Begins the value whose first character is ``text[i]``; False when none can."""
        c = text[i]
        if c == "{":
            self._stack.append("}")
            self.parts.append(c)
            self._state = _KEY_OR_CLOSE
        elif c == "[":
            self._stack.append("]")
            self.parts.append(c)
            self._state = _VALUE_OR_CLOSE
        elif c == '"':
            self.parts.append(c)
            self._state, self._key = _STRING, False
        elif c == "-" or c.isdigit():
            self._state, self._token = _NUMBER_TOKEN, i
        elif c in "tfn":
            self._state, self._token = _LITERAL, i
        else:
            return False
        return True

    def _string(self, text: str, i: int) -> tuple[int, bool]:
        """Reads string contents from ``i``: the index to go on from, and whether
        to wait there for more text (an unfinished escape is pending)."""
        n = len(text)
        m = _STRING_STOP.search(text, i)
        if m is None:
            if i < n:
                self.parts.append(text[i:])
            self.final_end = n
            return n, True
        j = m.start()
        if j > i:
            self.parts.append(text[i:j])
        c = text[j]
        if c == '"':
            self.parts.append(c)
            self._state = _COLON if self._key else _AFTER
            return j + 1, False
        if c != "\\":
            self._fail(j)  # a raw control character
            return n, False
        self.final_end = j
        if j + 1 >= n:
            self._pending_text = text[j:]
            return j, True
        e = text[j + 1]
        if e in _SIMPLE_ESCAPES:
            self.parts.append(text[j : j + 2])
            return j + 2, False
        if e != "u":
            self._fail(j)
            return n, False
        digits = text[j + 2 : j + 6]
        if not all(d in _HEX for d in digits):
            self._fail(j)
            return n, False
        if len(digits) < 4:
            self._pending_text = text[j:]
            return j, True
        if _HIGH_SURROGATE.match(text, j):
            # Its low half comes as the next escape: keep the pair together.
            after = text[j + 6 : j + 12]
            if len(after) < 6 and "\\u".startswith(after[:2]) and all(d in _HEX for d in after[2:]):
                self._pending_text = text[j:]
                return j, True
            if _LOW_SURROGATE.match(text, j + 6):
                self.parts.append(text[j : j + 12])
                return j + 12, False
        self.parts.append(text[j : j + 6])
        return j + 6, False

    def scan(self, text: str) -> None:
        """Reads what has arrived since the last call (see the class)."""
        if self.end is not None or self.failed:
            return
        i, n = self._pos, len(text)
        self._pending_text = ""
        while i < n:
            state = self._state
            if state == _STRING:
                i, wait = self._string(text, i)
                if self.failed:
                    return
                if wait:
                    break
                self.final_end = i
                continue
            if state in (_NUMBER_TOKEN, _LITERAL):
                j = i
                allowed = _NUMBER_CHARS if state == _NUMBER_TOKEN else None
                while j < n and (text[j] in allowed if allowed is not None else text[j].isalpha()):
                    j += 1
                word = text[self._token : j]
                if j == n:
                    ok = (
                        bool(word) and (word == "-" or _NUMBER.match(word) is not None)
                        if allowed is not None
                        else any(lit.startswith(word) for lit in _LITERALS)
                    )
                    if not ok:
                        self._fail(self._token)
                        return
                    self._pending_text = word
                    self.final_end = self._token
                    i = n
                    break
                complete = _NUMBER.fullmatch(word) if allowed is not None else word in _LITERALS
                if not complete:
                    self._fail(self._token)
                    return
                self.parts.append(word)
                self._state = _AFTER
                i = j
                self.final_end = i
                if not self._stack:
                    self.end = i  # a scalar at the top ends where it ends
                    break
                continue
            c = text[i]
            if c in WHITESPACE:
                i += 1
                self.final_end = i
                continue
            if state in (_VALUE, _VALUE_OR_CLOSE):
                if state == _VALUE_OR_CLOSE and c == "]":
                    self._close(c, i)
                elif not self._value_start(text, i):
                    self._fail(i)
                    return
            elif state in (_KEY_OR_CLOSE, _KEY):
                if c == '"':
                    self.parts.append(c)
                    self._state, self._key = _STRING, True
                elif state == _KEY_OR_CLOSE and c == "}":
                    self._close(c, i)
                else:
                    self._fail(i)
                    return
            elif state == _COLON:
                if c != ":":
                    self._fail(i)
                    return
                self.parts.append(c)
                self._state = _VALUE
            else:  # _AFTER
                if not self._stack:
                    break
                if c == ",":
                    self.parts.append(c)
                    self._state = _KEY if self._stack[-1] == "}" else _VALUE
                elif c == self._stack[-1]:
                    self._close(c, i)
                else:
                    self._fail(i)
                    return
            i += 1
            if self._state not in (_NUMBER_TOKEN, _LITERAL):
                self.final_end = i
            if self.end is not None:
                break
        self._pos = i
