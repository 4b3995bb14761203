"""Client text stays text through the chat template: no forged turns.

A chat template writes control tokens (``<|im_start|>``, ``<|im_end|>``,
``<|eot_id|>``) around text the client sent: message content, tool results, tool
call arguments, names, tool definitions. Tokenizing the rendered prompt with
special-token parsing, as ``apply_chat_template(tokenize=True)`` does, would read
a ``<|im_end|>`` typed into a message as the real control token, so a user
message (or a web page or tool result a client forwards) could close its turn
and open a ``system`` one.

Here the template renders client text with every control-token string replaced
by a placeholder (``ClientText.escape``): private-use characters (U+E000, U+E001)
around a per-request random nonce of decimal digits and the token's index (an
image's place, ``ClientText.with_images``, has U+E002 before its index), which no
template filter in use (``trim``, ``tojson`` with HF's ``ensure_ascii=False``,
``upper``, ``lower``, ``title``: none has a case for digits or private-use
characters) changes and no client can guess; the client's own U+E000/U+E001 are
escaped the same way. The placeholders are put back afterwards and their spans remembered
(``ClientText.pieces``); the rendered prompt is then cut at the control tokens
that lie wholly outside those spans, i.e. that the template wrote (templates write
their control tokens whole). Each engine tokenizes the text between them with
special-token parsing off and each template control token as its one id.

Why this shape, for any template:

- Text without control-token strings renders exactly as before (nothing is
  replaced), and the cuts fall where the tokenizer's own added-token splitter
  cuts (it tokenizes the text between added tokens independently: HF
  ``tokenizers`` ``AddedVocabulary``, which both engines use), so ordinary
  prompts keep their token ids, counts and prefix-cache hits. The ``lstrip`` /
  ``rstrip`` of a control token (whitespace it absorbs) is applied the same way.
- Rendering per message instead would break templates that look across
  messages (a default system prompt, the last user turn); sentinels around all
  client text would change what ``trim`` and friends see.
- A template that mangles a placeholder (slices content, escapes non-ASCII)
  leaves a delimiter or the nonce in the prompt: the request is refused
  (``TemplateMangled``) rather than tokenized with client text of unknown extent.

Non-special added tokens (Qwen's ``<tool_call>``, ``<think>``) are vocabulary,
not turn structure: both engines keep matching them in any text, as before.
Only the control tokens (added tokens marked special) are guarded. A raw prompt
(``Submit.prompt``) is the caller's own template and is tokenized with
special-token parsing, as before. The text the proxy puts after the template
(``Submit.forced_prefix``: a named tool call's opening) is cut the same way: its
format markers are control tokens when the tokenizer has them as such
(``ControlTokens.prefix_pieces``), the rest text.
"""

from __future__ import annotations

import bisect
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

_OPEN = "\ue000"
_CLOSE = "\ue001"
_IMAGE = "\ue002"
_NONCE_DIGITS = 16


class TemplateMangled(ValueError):
    """The chat template changed a placeholder of client text (``client_text`` module).
    ``image``: the index (``ClientText.with_images``' numbering) of an image whose place
    the template dropped or repeated, else ``None``."""

    def __init__(self, message: str, image: int | None = None) -> None:
        super().__init__(message)
        self.image = image


@dataclass(frozen=True, slots=True)
class ControlToken:
    """A special added token: its text and whether it absorbs the whitespace on
    its left (``lstrip``) or right (``rstrip``) when matched (HF ``AddedToken``)."""

    text: str
    lstrip: bool = False
    rstrip: bool = False


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of the rendered prompt: one control token the template wrote
    (``control``), text to tokenize with special-token parsing off, or the place
    of an image (``image``: its index in ``ClientText.with_images``; ``text`` empty)."""

    text: str
    control: bool
    image: int | None = None


def control_tokens(hf_tokenizer: Any) -> list[ControlToken]:
    """The control tokens of a ``transformers`` tokenizer: its added tokens
    marked ``special`` (``added_tokens_decoder``), plus its named special tokens
    (``all_special_tokens``) where the former is missing."""
    found: dict[str, ControlToken] = {}
    for added in (getattr(hf_tokenizer, "added_tokens_decoder", None) or {}).values():
        content = str(getattr(added, "content", ""))
        if content and getattr(added, "special", False):
            found[content] = ControlToken(
                content, bool(getattr(added, "lstrip", False)), bool(getattr(added, "rstrip", False))
            )
    for name in getattr(hf_tokenizer, "all_special_tokens", None) or ():
        if name and name not in found:
            found[str(name)] = ControlToken(str(name))
    return list(found.values())


class ControlTokens:
    """The control tokens of one tokenizer, compiled once; ``guard()`` per request."""

    def __init__(self, tokens: Iterable[ControlToken]) -> None:
        self.tokens: list[ControlToken] = [t for t in tokens if t.text]
        self._index = {t.text: i for i, t in enumerate(self.tokens)}
        # Longest first: where one token's text starts another's, the longer one wins,
        # as in the tokenizers' own matcher.
        ordered = sorted(self._index, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        # What escaping replaces: the control tokens, and the placeholders' own delimiters
        # (so that any delimiter left after rendering shows a mangled placeholder).
        self.literals = [t.text for t in self.tokens] + [_OPEN, _CLOSE]
        self.escaped = re.compile("|".join(map(re.escape, [*ordered, _OPEN, _CLOSE])))

    def guard(self) -> ClientText:
        """A fresh escaper for one request (its own nonce)."""
        return ClientText(self)

    def index(self, text: str) -> int:
        return self._index[text]

    def __contains__(self, text: object) -> bool:
        """Whether ``text`` is one of these control tokens."""
        return text in self._index

    def prefix_pieces(self, prefix: Iterable[Any]) -> list[Piece]:
        """``protocol.messages.Submit.forced_prefix`` as pieces to tokenize after
        the rendered prompt: a piece marked ``control`` is one control token
        when it is one of these, else text like every other piece."""
        return [Piece(p.text, bool(p.control) and p.text in self._index) for p in prefix if p.text]


class ClientText:
    """Escapes one request's client text and cuts its rendered prompt."""

    def __init__(self, tokens: ControlTokens) -> None:
        self._tokens = tokens
        # Digits only: a template's ``upper`` would change hex letters, and the placeholder with them
        self._nonce = f"{secrets.randbelow(10**_NONCE_DIGITS):0{_NONCE_DIGITS}d}"
        # group 1: U+E002 for an image's place (with_images), empty for a control token's text
        self._placeholder = re.compile(f"{_OPEN}{self._nonce}({_IMAGE}?)([0-9]+){_CLOSE}")
        self._images = 0

    def escape(self, value: T) -> T:
        """``value`` with every control-token string in its strings replaced by a
        placeholder: a string, or lists, tuples and dicts of them (dict keys too),
        as messages and tool definitions are; other values unchanged."""
        return self._escape(value)  # type: ignore[no-any-return]

    def _escape(self, value: Any) -> Any:
        if isinstance(value, str):
            pattern = self._tokens.escaped
            if not pattern.search(value):
                return value
            index = self._tokens.literals.index
            return pattern.sub(lambda m: f"{_OPEN}{self._nonce}{index(m.group())}{_CLOSE}", value)
        if isinstance(value, dict):
            return {self._escape(k): self._escape(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._escape(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self._escape(v) for v in value)
        return value

    def with_images(self, content: str, offsets: Iterable[int]) -> str:
        """``content`` escaped, with an image's place marked at each of ``offsets``
        (characters into ``content``, ascending): ``pieces`` gives an image piece
        there, numbered across this request's calls in order (0, 1, ...). The text
        between two places is escaped apart, so no control token spans an image."""
        parts: list[str] = []
        at = 0
        for offset in offsets:
            parts.append(self._escape(content[at:offset]))
            parts.append(f"{_OPEN}{self._nonce}{_IMAGE}{self._images}{_CLOSE}")
            self._images += 1
            at = offset
        parts.append(self._escape(content[at:]))
        return "".join(parts)

    def pieces(self, rendered: str) -> list[Piece]:
        """The rendered prompt with the client's control-token strings put back,
        cut into text and the template's control tokens (module docstring), with an
        image piece where ``with_images`` marked one. Raises ``TemplateMangled`` when
        a placeholder did not survive rendering, or an image's place is missing or
        repeated."""
        literals = self._tokens.literals
        parts: list[str] = []
        client: list[tuple[int, int]] = []  # [start, end) of restored client text, ascending
        images: list[tuple[int, int]] = []  # (position in the text, image index)
        at = length = 0
        for m in [*self._placeholder.finditer(rendered), None]:
            end = len(rendered) if m is None else m.start()
            rendered_part = rendered[at:end]
            if _OPEN in rendered_part or _CLOSE in rendered_part or self._nonce in rendered_part:
                raise TemplateMangled("the chat template cut or re-encoded the client's text")
            parts.append(rendered_part)
            length += end - at
            if m is None:
                break
            at = m.end()
            k = int(m.group(2))
            if m.group(1):
                images.append((length, k))
                continue
            if k >= len(literals):
                raise TemplateMangled("the chat template changed the client's text")
            restored = literals[k]
            parts.append(restored)
            client.append((length, length + len(restored)))
            length += len(restored)
        placed = [k for _, k in images]
        if sorted(placed) != list(range(self._images)):
            k = next((k for k in range(self._images) if placed.count(k) != 1), 0)
            raise TemplateMangled("the chat template dropped or repeated an image of the conversation", k)
        text = "".join(parts)
        spans = (client, [s for s, _ in client])
        out: list[Piece] = []
        start = 0
        for position, k in images:
            out += self._cut(text, start, position, spans)
            out.append(Piece("", False, k))
            start = position
        return out + self._cut(text, start, len(text), spans)

    def _cut(
        self, text: str, start: int, end: int, spans: tuple[list[tuple[int, int]], list[int]]
    ) -> list[Piece]:
        """``text[start:end]`` cut at the control tokens the template wrote, outside the
        client's spans (``spans``: the ``[start, end)`` pairs and their starts)."""
        pattern = self._tokens.pattern
        if pattern is None:
            return [Piece(text[start:end], False)] if end > start else []
        tokens = self._tokens.tokens
        client, starts = spans
        out: list[Piece] = []
        pos = cut = start
        while (m := pattern.search(text, pos, end)) is not None:
            # A client span that overlaps the match: the one starting last before its end.
            i = bisect.bisect_left(starts, m.end()) - 1
            if i >= 0 and client[i][1] > m.start():
                pos = m.start() + 1  # the client's text: not a control token
                continue
            token = tokens[self._tokens.index(m.group())]
            before = text[cut : m.start()]
            if token.lstrip:
                before = before.rstrip()
            if before:
                out.append(Piece(before, False))
            out.append(Piece(token.text, True))
            cut = pos = m.end()
            if token.rstrip:
                while cut < end and text[cut].isspace():
                    cut += 1
                pos = cut
        if cut < end:
            out.append(Piece(text[cut:end], False))
        return out
