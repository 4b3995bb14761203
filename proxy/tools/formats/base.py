"""What a tool-call format is made of: ``ToolCallFormat`` (markers, detection,
rendering, grammar pieces) and the ``CallBlock`` each one opens after a start
marker, which both decides a block (``advance``) and tells how far its calls
can stream (``progress``). One module per format beside this one; the registry
(``proxy.tools.formats.registry``) lists them.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import msgspec

from proxy.tools.jsontext import compact
from proxy.tools.spec import FunctionCall, FunctionTool

Tools = Mapping[str, FunctionTool]
"""The functions the model may call now, by name (``ToolConfig.callable_by_name``)."""

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
    the marker and that text are content (unless part of it already streamed:
    ``BlockProgress``)."""

    end: int
    calls: list[FunctionCall] | None


class ArgumentsText(Protocol):
    """A call's arguments as JSON text while they are written: ``parts`` are
    final (joined, a prefix of the call's final arguments, compact), ``pending``
    is written after them and not final yet (a cut call keeps it).
    ``proxy.tools.jsontext.JsonPrefix`` is one."""

    @property
    def parts(self) -> list[str]: ...

    @property
    def pending(self) -> str: ...


@dataclass(slots=True, eq=False)
class StreamingCall:
    """A call of a block as far as it is known: ``name`` is complete and callable;
    ``arguments`` is ``None`` until they have opened (then they stream);
    ``call_id`` an id the model wrote itself (Kimi-K2's ``functions.NAME:IDX``)."""

    name: str
    arguments: ArgumentsText | None = None
    call_id: str | None = None


class BlockProgress(NamedTuple):
    """What a block's calls are so far: ``calls`` in order (each call's name is
    final once listed; its arguments stream once open), and ``valid_end``, the
    index in the body up to which the text belongs to those calls. When the
    block turns out not to be a call after some of it streamed, the text from
    ``valid_end`` on is content (``proxy.tools.parser``'s "a call that goes
    wrong")."""

    calls: Sequence[StreamingCall]
    valid_end: int


NOTHING_YET = BlockProgress((), 0)


class CallBlock(Protocol):
    """The part of a format after a start marker, fed the growing text after it."""

    def advance(self, body: str, final: bool) -> BlockOutcome | None:
        """The outcome once known, ``None`` while more text is needed. With
        ``final`` (the output ended) it always returns an outcome."""
        ...

    def progress(self, body: str) -> BlockProgress:
        """The block's calls as far as they are written (``BlockProgress``),
        called after ``advance`` with the same body. Each call's ``parts`` only
        grow; a call once listed stays listed. Work is linear in the body's
        length over all calls."""
        ...


def not_a_call(end: int) -> BlockOutcome:
    """The outcome of a block that is no call: its text from ``end`` on is read again."""
    return BlockOutcome(end, None)


def wait_or_fail(body: str, final: bool) -> BlockOutcome | None:
    """Wait for more text, or, at the end of the output, not a call: an
    unfinished block is text, never an error."""
    return not_a_call(len(body)) if final else None


# ---------------------------------------------------------------- rendering


def arguments_json(arguments: str) -> str:
    """Client-sent ``arguments`` as JSON text to embed: compacted when it is
    JSON, else the text as a JSON string (OpenAI does not require valid JSON)."""
    try:
        msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return msgspec.json.encode(arguments).decode()
    return compact(arguments)


def arguments_object(arguments: str) -> dict[str, object]:
    """Client-sent ``arguments`` as an object, ``{}`` when they are not a JSON object."""
    try:
        value = msgspec.json.decode(arguments)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def call_object(name: str, arguments: str, key: str) -> str:
    """``{"name": NAME, KEY: ARGUMENTS}`` spaced as the grammars' prefix writes it."""
    return '{"name": ' + msgspec.json.encode(name).decode() + f', "{key}": ' + arguments_json(arguments) + "}"


# ---------------------------------------------------------------- formats


@dataclass(frozen=True, slots=True)
class ToolCallFormat:
    """One tool-call syntax: how to find calls in output, render them into a
    prompt, and constrain decoding to them.

    - ``markers``: text that starts a call anywhere in the output.
    - ``bare_json``: ``bare_start`` (``{``, a JSON object) at the start of the
      output (or right after a call) starts one too (``llama3_json``; ``[`` for
      ``pythonic``'s call lists); ``separators``: characters dropped between
      consecutive calls.
    - ``open_block(marker, tools)``: the parser of what follows a start marker
      (``marker == ""`` for a bare JSON start); ``tools``: callable functions
      by name (XML formats type their parameters from the schemas).
    - ``matches_template(source)``: the chat template renders this format;
      ``shadows``: names of formats whose marker this format's templates also
      contain (qwen3_coder's ``<tool_call>`` is Hermes' marker too), so a
      template this format matches is not counted for them.
    - ``new_call_id``: ids given to calls found in output (unless the model
      wrote one: ``StreamingCall.call_id``).
    - ``render_calls(calls)``: calls as the model would write them, for history
      turns rendered as plain text (``arguments`` that are not JSON are
      embedded as a JSON string).
    - ``syntax_hint``: the call syntax shown in a generic tools prompt.
    - ``history_arguments``: how a template that renders tools wants an earlier
      call's ``arguments``: ``object`` (decoded: most templates index into them
      or apply ``tojson``) or ``text`` (DeepSeek's templates concatenate them).
    - grammar: ``grammar_rules(config, special)`` when the format writes its own
      (the XML formats); else the pieces (``proxy.tools.grammar``):
      ``grammar_open``, then calls each as ``grammar_call_prefix`` + JSON +
      ``grammar_call_suffix`` joined by ``grammar_joiner``, then
      ``grammar_close``; ``arguments_key`` names the arguments in the JSON. A
      piece equal to a marker may be replaced by a special-token reference.
      ``grammar_calls``: calls fit either, so a grammar can force them
      (Harmony's name sits in the message header: no grammar is written for it).
      ``named_prefix(tool)``: what the server writes of a named function's call
      before the model's arguments, as text pieces (``None``: the JSON object
      form ``proxy.tools.grammar.named_call_prefix`` builds).
    """

    name: str
    markers: tuple[str, ...]
    open_block: Callable[[str, Tools], CallBlock]
    matches_template: Callable[[str], bool]
    render_calls: Callable[[Sequence[FunctionCall]], str]
    syntax_hint: str
    arguments_key: str = "arguments"
    bare_json: bool = False
    bare_start: str = "{"
    separators: str = ""
    new_call_id: Callable[[], str] = openai_call_id
    shadows: tuple[str, ...] = ()
    history_arguments: str = "object"
    grammar_open: tuple[str, ...] = ()
    grammar_call_prefix: tuple[str, ...] = ()
    grammar_call_suffix: tuple[str, ...] = ()
    grammar_joiner: tuple[str, ...] = ()
    grammar_close: tuple[str, ...] = ()
    grammar_calls: bool = True
    grammar_rules: GrammarRules | None = field(default=None)


class GrammarRules(Protocol):
    """A format's own grammar of calls (``ToolCallFormat.grammar_rules``)."""

    def __call__(
        self, tools: Sequence[tuple[FunctionTool, str]], parallel: bool, special: Mapping[str, str]
    ) -> tuple[str, list[str]]:
        """``(calls, rules)``: the body of the start rule for one call (or one
        or more when ``parallel``) of ``tools`` (each with the request field
        that holds its schema, for the rule's ``// param`` comment), and the
        rules it uses, in llguidance's Lark."""
        ...
