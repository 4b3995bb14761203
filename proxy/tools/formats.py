"""The tool-call formats models emit, one ``ToolCallFormat`` each, and how one
is chosen (``--tool-call-format``: ``auto`` or a name in ``FORMATS``).

``hermes`` (Hermes 2/3 Pro, Qwen 2.5/3 and most ChatML tool models)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

  one block per call, several blocks for parallel calls. Sources: the chat
  templates Qwen2.5-Instruct and NousResearch Hermes-2-Pro publish (their system
  prompt asks for exactly this); vLLM's ``hermes`` tool parser; llama.cpp's
  Hermes 2 Pro handler (chosen when the template contains ``<tool_call>``).

``llama3_json`` (Llama 3.1/3.2/3.3 JSON tool calling)::

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}
    {"name": "a", "parameters": {...}}; {"name": "b", "parameters": {...}}

  an optional ``<|python_tag|>``, then a JSON object whose arguments key is
  ``parameters`` (``arguments`` is accepted too); several calls separated by
  ``;``. Without the tag, only an output that *starts* with ``{`` (or continues
  with one right after a call) is taken for a call, and only when its first key
  is ``name`` or ``type``; JSON later in a text answer stays text. Sources:
  Meta's Llama 3.1 model card / ``llama-models`` prompt format and its HF chat
  template (``"parameters"``, the ``ipython`` role); vLLM's ``llama3_json``
  parser (``;``-separated objects, either key); llama.cpp's Llama 3.x handler.

``mistral`` (Mistral 7B v0.3, Nemo, Small; ``[TOOL_CALLS]`` is a control token)::

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}       (tokenizer v11 and later)
    [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{...}

  a JSON array of calls, or (newer templates) the name then ``[ARGS]`` then the
  arguments object, repeated with ``[TOOL_CALLS]`` per call. Sources:
  ``mistral-common``'s tokenizer versions; vLLM's ``mistral`` parser; llama.cpp's
  Mistral Nemo and Ministral/Magistral handlers. Mistral templates reject tool
  call ids that are not 9 alphanumeric characters, so this format's ids are
  those, not ``call_...``.

``harmony`` (GPT-OSS: OpenAI's Harmony messages, whose header names a recipient)::

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

Template detection looks at the template source in llama.cpp's order:
``<tool_call>`` -> hermes; ``<|python_tag|>``, or the ``ipython`` role with
``"parameters"`` -> llama3_json; ``[TOOL_CALLS]`` -> mistral; ``<|channel|>`` with
``<|call|>`` -> harmony.

Markers are text here: the worker must detokenize marker tokens that are
special tokens in the model's vocabulary (``[TOOL_CALLS]``, ``<|python_tag|>``)
rather than skip them, or the parser never sees them (vLLM turns
``skip_special_tokens`` off for Mistral for this reason).
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import msgspec

from proxy.tools.jsontext import (
    JsonSpan,
    compact,
    decode_call,
    decode_call_arguments,
    decode_call_array,
    partial_arguments,
    partial_call,
    skip_whitespace,
)
from proxy.tools.spec import FunctionCall

# ---------------------------------------------------------------- call ids

_ALPHANUMERIC = string.ascii_letters + string.digits


def openai_call_id() -> str:
    """``call_`` + 24 random alphanumerics, the shape OpenAI's ids have."""
    return "call_" + "".join(secrets.choice(_ALPHANUMERIC) for _ in range(24))


def mistral_call_id() -> str:
    """9 random alphanumerics: Mistral's templates refuse any other tool call id
    when the conversation is sent back."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


# ---------------------------------------------------------------- call blocks


class BlockOutcome(NamedTuple):
    """How a call block ended: ``body[:end]`` (the text after its start marker)
    belongs to it; ``calls`` is ``None`` when it is not a valid call, and then
    the marker and that text are content."""

    end: int
    calls: list[FunctionCall] | None


class CallBlock(Protocol):
    """The part of a format after a start marker, fed the growing text after it."""

    def advance(self, body: str, final: bool) -> BlockOutcome | None:
        """The outcome once known, ``None`` while more text is needed. With
        ``final`` (the output ended) it always returns an outcome."""
        ...

    def cut(self, body: str) -> list[FunctionCall] | None:
        """The output ended at a length limit with this block open (``advance``
        said nothing yet): the calls it holds, the last one with its arguments
        as far as written (``jsontext.partial_call``), or ``None`` when not
        even one function name is complete."""
        ...


def _not_a_call(end: int) -> BlockOutcome:
    return BlockOutcome(end, None)


def _wait_or_fail(body: str, final: bool) -> BlockOutcome | None:
    # At the end of the output an unfinished block is text, never an error.
    return _not_a_call(len(body)) if final else None


class _JsonObjectBlock:
    """Whitespace, one JSON object, then (``end_tag``) whitespace and the tag.

    The object is a call of one of ``names`` (``decode_call``) or none. ``first_keys``
    limits which first key makes the object a call attempt at all (checked as
    soon as it is known, so that a JSON answer is not held back to its end).
    """

    def __init__(
        self,
        names: frozenset[str],
        end_tag: str = "",
        first_keys: frozenset[str] | None = None,
    ) -> None:
        self._names = names
        self._end_tag = end_tag
        self._first_keys = first_keys
        self._start = -1
        self._span: JsonSpan | None = None
        self._end = -1

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
                return _wait_or_fail(body, final)
            if body[i] != "{":
                return _not_a_call(0)
            self._start = i
            self._span = JsonSpan(i)
        if self._end < 0:
            if self._first_keys is not None:
                ok = self._first_key_ok(body)
                if ok is False:
                    return _not_a_call(0)
                if ok is None:
                    return _wait_or_fail(body, final)
                self._first_keys = None
            end = self._span.scan(body)
            if end is None:
                return _wait_or_fail(body, final)
            self._end = end
        if not self._end_tag:
            call = decode_call(body[self._start : self._end], self._names)
            return BlockOutcome(self._end, None if call is None else [call])
        k = skip_whitespace(body, self._end)
        tail = body[k:]
        if tail.startswith(self._end_tag):
            call = decode_call(body[self._start : self._end], self._names)
            return BlockOutcome(k + len(self._end_tag), None if call is None else [call])
        if not final and self._end_tag.startswith(tail):
            return None
        # The object is not followed by the closing tag: not a call.
        return _not_a_call(self._end)

    def cut(self, body: str) -> list[FunctionCall] | None:
        if self._span is None or self._first_keys is not None:
            return None  # no object yet, or not known to be a call attempt
        text = body[self._start : self._end] if self._end >= 0 else body[self._start :]
        call = decode_call(text, self._names) if self._end >= 0 else partial_call(text, self._names)
        return None if call is None else [call]


_NAME_CHAR = frozenset(string.ascii_letters + string.digits + "_-")
_ARGS = "[ARGS]"
_CALL_ID = "[CALL_ID]"


class _MistralBlock:
    """After ``[TOOL_CALLS]``: a JSON array of calls, or ``name[ARGS]{...}``
    (optionally ``name[CALL_ID]id[ARGS]{...}``)."""

    def __init__(self, names: frozenset[str]) -> None:
        self._names = names
        self._span: JsonSpan | None = None
        self._start = -1
        self._name = ""

    def _scan_named(self, body: str, i: int, final: bool) -> BlockOutcome | None:
        # Up to the arguments' "{": the name, then [ARGS] or [CALL_ID]id[ARGS].
        # Sets the span once the "{" is there; until then waits or refuses.
        j = i
        while j < len(body) and body[j] in _NAME_CHAR:
            j += 1
        if j - i > 64:
            return _not_a_call(0)
        rest = body[j:]
        if rest.startswith(_CALL_ID):
            k = j + len(_CALL_ID)
            while k < len(body) and body[k] in _NAME_CHAR:
                k += 1
            after = body[k:]
            if after.startswith(_ARGS):
                args_at = k + len(_ARGS)
            elif _ARGS.startswith(after):
                return _wait_or_fail(body, final)
            else:
                return _not_a_call(0)
        elif rest.startswith(_ARGS):
            args_at = j + len(_ARGS)
        elif _ARGS.startswith(rest) or _CALL_ID.startswith(rest):
            return _wait_or_fail(body, final)
        else:
            return _not_a_call(0)
        a = skip_whitespace(body, args_at)
        if a == len(body):
            return _wait_or_fail(body, final)
        if body[a] != "{":
            return _not_a_call(0)
        self._name = body[i:j]
        self._start = a
        self._span = JsonSpan(a)
        return None

    def advance(self, body: str, final: bool) -> BlockOutcome | None:
        if self._span is None:
            i = skip_whitespace(body, 0)
            if i == len(body):
                return _wait_or_fail(body, final)
            if body[i] == "[":
                self._start = i
                self._span = JsonSpan(i)
            elif body[i] in _NAME_CHAR:
                outcome = self._scan_named(body, i, final)
                if self._span is None:  # the arguments have not started (or never will)
                    return outcome
            else:
                return _not_a_call(0)
        assert self._span is not None
        end = self._span.scan(body)
        if end is None:
            return _wait_or_fail(body, final)
        text = body[self._start : end]
        if self._name:
            call = decode_call_arguments(self._name, text, self._names)
            return BlockOutcome(end, None if call is None else [call])
        return BlockOutcome(end, decode_call_array(text, self._names))

    def cut(self, body: str) -> list[FunctionCall] | None:
        if self._span is None:
            return None
        if self._name:
            if self._name not in self._names:
                return None
            return [FunctionCall(self._name, partial_arguments(body[self._start :]))]
        # An array: its complete call objects, then the one being written.
        calls: list[FunctionCall] = []
        i = skip_whitespace(body, self._start + 1)
        while i < len(body) and body[i] == "{":
            end = JsonSpan(i).scan(body)
            call = (
                decode_call(body[i:end], self._names)
                if end is not None
                else partial_call(body[i:], self._names)
            )
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            i = skip_whitespace(body, end)
            if body[i : i + 1] != ",":
                break
            i = skip_whitespace(body, i + 1)
        return calls or None


_MESSAGE = "<|message|>"
_CALL_END = "<|call|>"
_RECIPIENT = "to=functions."
_MAX_FRAME = 256  # header characters before a frame without <|message|> is given up as text


class _HarmonyBlock:
    """After a Harmony frame's first marker (``<|start|>``, ``<|channel|>``, or
    ``" to=functions."`` where the output starts with the role's recipient): the rest of
    the header up to ``<|message|>``, whose recipient names the function, then the
    arguments object and an optional ``<|call|>``."""

    def __init__(self, marker: str, names: frozenset[str]) -> None:
        self._marker = marker
        self._names = names
        self._name: str | None = None
        self._args = -1  # index of the arguments' "{" in the body
        self._span: JsonSpan | None = None
        self._end = -1  # just past the arguments object, once scanned (JsonSpan scans once)

    def _header(self, body: str, final: bool) -> BlockOutcome | None:
        i = body.find(_MESSAGE)
        if i < 0:
            too_long = len(body) > _MAX_FRAME
            return _not_a_call(0) if too_long or final else None
        header = self._marker + body[:i]
        at = header.find(_RECIPIENT)
        if at < 0:
            return _not_a_call(0)
        j = at + len(_RECIPIENT)
        k = j
        while k < len(header) and header[k] in _NAME_CHAR:
            k += 1
        self._name = header[j:k]
        a = skip_whitespace(body, i + len(_MESSAGE))
        if a == len(body):
            self._args = a
            return _wait_or_fail(body, final)
        if body[a] != "{":
            return _not_a_call(0)
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
                return _wait_or_fail(body, final)
            self._end = end
        end = self._end
        call = decode_call_arguments(self._name, body[self._args : end], self._names)
        if call is None:
            return _not_a_call(0)
        k = skip_whitespace(body, end)
        if body.startswith(_CALL_END, k):
            return BlockOutcome(k + len(_CALL_END), [call])
        if not final and _CALL_END.startswith(body[k:]):
            return None  # <|call|> may follow (it is text only where the engine shows it)
        return BlockOutcome(end, [call])

    def cut(self, body: str) -> list[FunctionCall] | None:
        if self._name is None or self._name not in self._names or self._args < 0:
            return None
        return [FunctionCall(self._name, partial_arguments(body[self._args :]))]


# ---------------------------------------------------------------- formats


def _arguments_json(arguments: str) -> str:
    """Client-sent ``arguments`` as JSON text to embed: compacted when it is
    JSON, else the text as a JSON string (OpenAI does not require valid JSON)."""
    try:
        msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return msgspec.json.encode(arguments).decode()
    return compact(arguments)


def _call_object(name: str, arguments: str, key: str) -> str:
    return (
        '{"name": ' + msgspec.json.encode(name).decode() + f', "{key}": ' + _arguments_json(arguments) + "}"
    )


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """One tool-call syntax: how to find calls in output, render them into a
    prompt, and constrain decoding to them.

    - ``markers``: text that starts a call anywhere in the output.
    - ``bare_json``: a JSON object at the start of the output (or right after a
      call) starts one too (``llama3_json``); ``separators``: characters dropped
      between consecutive calls.
    - ``open_block(marker, names)``: the parser of what follows a start marker
      (``marker == ""`` for a bare JSON start); ``names``: callable functions.
    - ``matches_template(source)``: the chat template renders this format.
    - ``new_call_id``: ids given to calls found in output.
    - ``render_calls(calls)``: calls as the model would write them, for history
      turns rendered as plain text (``arguments`` that are not JSON are
      embedded as a JSON string).
    - ``syntax_hint``: the call syntax shown in a generic tools prompt.
    - grammar pieces (``proxy.tools.grammar``): ``grammar_open``, then calls
      each as ``grammar_call_prefix`` + JSON + ``grammar_call_suffix`` joined by
      ``grammar_joiner``, then ``grammar_close``; ``arguments_key`` names the
      arguments in the JSON. A piece equal to a marker may be replaced by a
      special-token reference. ``grammar_calls``: calls fit that shape, so a
      grammar can force them (Harmony's name sits in the message header, not in
      the JSON: no grammar is written for it).
    """

    name: str
    markers: tuple[str, ...]
    open_block: Callable[[str, frozenset[str]], CallBlock]
    matches_template: Callable[[str], bool]
    render_calls: Callable[[Sequence[FunctionCall]], str]
    syntax_hint: str
    arguments_key: str = "arguments"
    bare_json: bool = False
    separators: str = ""
    new_call_id: Callable[[], str] = openai_call_id
    grammar_open: tuple[str, ...] = ()
    grammar_call_prefix: tuple[str, ...] = ()
    grammar_call_suffix: tuple[str, ...] = ()
    grammar_joiner: tuple[str, ...] = ()
    grammar_close: tuple[str, ...] = ()
    grammar_calls: bool = True


# hermes ---------------------------------------------------------


def _hermes_block(marker: str, names: frozenset[str]) -> CallBlock:
    return _JsonObjectBlock(names, end_tag="</tool_call>")


def _hermes_render(calls: Sequence[FunctionCall]) -> str:
    return "\n".join(
        f"<tool_call>\n{_call_object(c.name, c.arguments, 'arguments')}\n</tool_call>" for c in calls
    )


HERMES = ToolCallFormat(
    name="hermes",
    markers=("<tool_call>",),
    open_block=_hermes_block,
    matches_template=lambda source: "<tool_call>" in source,
    render_calls=_hermes_render,
    syntax_hint='<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>',
    grammar_call_prefix=("<tool_call>", "\n"),
    grammar_call_suffix=("\n", "</tool_call>"),
    grammar_joiner=("\n",),
)

# llama3_json ----------------------------------------------------

_LLAMA3_FIRST_KEYS = frozenset({"name", "type"})


def _llama3_block(marker: str, names: frozenset[str]) -> CallBlock:
    # With the tag the model declared a call; a bare "{" might be a JSON answer.
    first = None if marker else _LLAMA3_FIRST_KEYS
    return _JsonObjectBlock(names, first_keys=first)


def _llama3_render(calls: Sequence[FunctionCall]) -> str:
    return "; ".join(_call_object(c.name, c.arguments, "parameters") for c in calls)


def _llama3_template(source: str) -> bool:
    return "<|python_tag|>" in source or ("ipython" in source and '"parameters"' in source)


LLAMA3_JSON = ToolCallFormat(
    name="llama3_json",
    markers=("<|python_tag|>",),
    open_block=_llama3_block,
    matches_template=_llama3_template,
    render_calls=_llama3_render,
    syntax_hint='{"name": <function-name>, "parameters": <arguments-json-object>}',
    arguments_key="parameters",
    bare_json=True,
    separators=";",
    grammar_joiner=("; ",),
)

# mistral --------------------------------------------------------


def _mistral_block(marker: str, names: frozenset[str]) -> CallBlock:
    return _MistralBlock(names)


def _mistral_render(calls: Sequence[FunctionCall]) -> str:
    return "[TOOL_CALLS][" + ", ".join(_call_object(c.name, c.arguments, "arguments") for c in calls) + "]"


MISTRAL = ToolCallFormat(
    name="mistral",
    markers=("[TOOL_CALLS]",),
    open_block=_mistral_block,
    matches_template=lambda source: "[TOOL_CALLS]" in source,
    render_calls=_mistral_render,
    syntax_hint='[TOOL_CALLS][{"name": <function-name>, "arguments": <arguments-json-object>}]',
    new_call_id=mistral_call_id,
    grammar_open=("[TOOL_CALLS]", "["),
    grammar_joiner=(", ",),
    grammar_close=("]",),
)

# harmony --------------------------------------------------------


def _harmony_block(marker: str, names: frozenset[str]) -> CallBlock:
    return _HarmonyBlock(marker, names)


def _harmony_render(calls: Sequence[FunctionCall]) -> str:
    return "".join(
        f"<|start|>assistant<|channel|>commentary {_RECIPIENT}{c.name} <|constrain|>json"
        f"{_MESSAGE}{_arguments_json(c.arguments)}{_CALL_END}"
        for c in calls
    )


HARMONY = ToolCallFormat(
    name="harmony",
    markers=("<|start|>", "<|channel|>", " " + _RECIPIENT),
    open_block=_harmony_block,
    # The template renders history calls in the frame and ends them with <|call|>.
    matches_template=lambda source: "<|channel|>" in source and _CALL_END in source,
    render_calls=_harmony_render,
    syntax_hint=(
        f"<|channel|>commentary {_RECIPIENT}<function-name> <|constrain|>json{_MESSAGE}"
        f"<arguments-json-object>{_CALL_END}"
    ),
    grammar_calls=False,
)

# registry -------------------------------------------------------

FORMATS: Mapping[str, ToolCallFormat] = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL, HARMONY)}
"""Formats by their ``--tool-call-format`` name, in template-detection order."""

AUTO = "auto"
TOOL_CALL_FORMAT_CHOICES: tuple[str, ...] = (AUTO, *FORMATS)
"""Values of ``--tool-call-format``: ``auto`` (detect from the chat template) or a name."""


def get_format(name: str) -> ToolCallFormat:
    """The format called ``name``; ``ValueError`` listing the names otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool call format {name!r}; expected one of {', '.join(FORMATS)}") from None


def detect_format(template: str | None) -> ToolCallFormat | None:
    """The format a chat template's source renders, ``None`` when it mentions
    none (the template does not handle tools)."""
    if not template:
        return None
    for fmt in FORMATS.values():
        if fmt.matches_template(template):
            return fmt
    return None


class FormatChoice(NamedTuple):
    """``format`` parses the output; ``native``: the chat template renders tools
    and tool turns itself; else ``proxy.tools.render.render_fallback`` turns them
    into plain messages with a generic tools prompt in this format."""

    format: ToolCallFormat
    native: bool


def choose_format(setting: str, template: str | None) -> FormatChoice:
    """The format for a model from ``--tool-call-format`` (``auto`` or a name)
    and its chat template source. ``auto`` on a template that handles no tools
    (the embedded SmolLM2's) gives ``hermes`` with the generic prompt. Raises
    ``ValueError`` for an unknown name."""
    detected = detect_format(template)
    if setting == AUTO:
        return FormatChoice(detected or HERMES, detected is not None)
    return FormatChoice(get_format(setting), detected is not None)
