"""GPT-OSS: OpenAI's Harmony format, whose messages carry a channel: thinking
on ``analysis``, the answer on ``final`` (and tool preambles/calls on
``commentary``, sent as the answer).

Format facts (``openai/harmony`` docs, ``docs/format.md``; the ``o200k_harmony``
encoding's special tokens: ``<|return|>`` 200002, ``<|constrain|>`` 200003,
``<|channel|>`` 200005, ``<|start|>`` 200006, ``<|end|>`` 200007,
``<|message|>`` 200008, ``<|call|>`` 200012). The template ends the generation
prompt with ``<|start|>assistant``; the model writes
``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>``.
``<|end|>`` ends a message, not the turn: it is no stop token here
(``Parser.not_stops``); ``<|return|>`` and ``<|call|>`` are (the model's EOS ids).
Headers and the structure tokens are never shown; they count as reasoning
tokens where they frame an ``analysis`` message.

Except a function call's: a message whose header names a ``functions.`` recipient
(``<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>``,
or the recipient in the role part, ``<|start|>assistant to=functions.get_weather<|channel|>...``,
as the template renders history calls) is sent whole as the answer: its frame (the
tokens since the previous message ended: ``<|start|>``, the role, ``<|channel|>``, the
header, ``<|message|>``) and its arguments, for the proxy's ``harmony`` tool-call
format (``proxy.tools.formats``) to read; ``<|call|>`` ends the turn (an EOS id, never
text). A call on the ``analysis`` channel (written in the thinking) is a call too, as
Qwen3's ``<tool_call>`` inside ``<think>`` is (``qwen3``): the model meant to call.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from engine_worker.reasoning.base import Parser, Plan, Released, Splitter, Vocab
from engine_worker.reasoning.family import Family
from protocol.messages import Channel

_MAX_HEADER = 64  # header tokens before a header is given up as text (a model not writing Harmony)
_RECIPIENT = "to=functions."


class _Tokens:
    def __init__(self, vocab: Vocab) -> None:
        ids = {name: vocab.token_id(f"<|{name}|>") for name in ("channel", "message", "end", "start")}
        missing = [k for k, v in ids.items() if v is None]
        if missing:
            raise LookupError(missing)
        self.channel = int(ids["channel"] or 0)
        self.message = int(ids["message"] or 0)
        self.end = int(ids["end"] or 0)
        self.start = int(ids["start"] or 0)
        # What the engine writes once the thinking budget is spent: the analysis message
        # closed and the final one opened.
        self.to_final = [
            self.end,
            self.start,
            *vocab.encode("assistant"),
            self.channel,
            *vocab.encode("final"),
            self.message,
        ]
        self.final_header = [self.channel, *vocab.encode("final"), self.message]


class _State(enum.Enum):
    BETWEEN = 1  # after a message (or at the generation prompt): role and <|channel|> next
    HEADER = 2  # after <|channel|>: the channel's name (and recipient) until <|message|>
    BODY = 3  # a message's text


class GptOss(Family):
    name = "gpt_oss"

    def writes_span(self, template: str) -> bool:
        return "<|channel|>" in template and "analysis" in template

    def bind(self, vocab: Vocab, *, single_tokens: bool) -> Parser | None:
        try:
            tokens = _Tokens(vocab)
        except LookupError:
            return None  # Harmony's structure tokens are always single tokens
        return HarmonyParser(tokens, vocab.decode)


class HarmonyParser(Parser):
    name = "gpt_oss"

    def __init__(self, tokens: _Tokens, decode: Callable[[Sequence[int]], str]) -> None:
        self._t = tokens
        self._decode = decode
        self.not_stops = frozenset({tokens.end})

    def plan(self, prompt_ids: list[int], budget: int | None) -> Plan:
        state, channel = _State.BETWEEN, Channel.CONTENT
        if budget == 0:
            # No thinking: the final message is opened in the prompt.
            prompt_ids = [*prompt_ids, *self._t.final_header]
            state = _State.BODY
        t, decode = self._t, self._decode
        return Plan(prompt_ids, lambda: HarmonySplitter(t, decode, state, channel, budget))


class HarmonySplitter(Splitter):
    def __init__(
        self,
        tokens: _Tokens,
        decode: Callable[[Sequence[int]], str],
        state: _State,
        channel: Channel,
        budget: int | None,
    ) -> None:
        self._t = tokens
        self._decode = decode
        self._state = state
        self._channel = channel
        self._budget = budget
        self._header: list[int] = []
        self._role: list[int] = []  # the frame before <|channel|>: <|start|>, the role, a recipient
        self._answered = state is _State.BODY and channel is Channel.CONTENT
        self._spent = 0
        self._forcing: list[int] = []
        self.reasoning_tokens = 0

    @property
    def free(self) -> bool:
        return not (self._state is _State.BODY and self._channel is Channel.CONTENT)

    def feed(self, token: int) -> Released:
        if self._forcing and token == self._forcing[0]:
            self._forcing.pop(0)
        t = self._t
        if self._state is _State.BODY:
            if token == t.end:
                self._state = _State.BETWEEN
                self._swallow(1)
                return [(None, token)]
            if self._channel is Channel.REASONING:
                self.reasoning_tokens += 1
                self._spent += 1
            return [(self._channel, token)]
        if self._state is _State.BETWEEN:
            # Held until the header shows whether the message is a call (the recipient may
            # be written here, in the role part).
            self._role.append(token)
            if token == t.channel:
                self._state, self._header = _State.HEADER, []
            return []
        # HEADER
        if token == t.message:
            header = self._decode(self._header).strip()
            frame = [*self._role, *self._header, token]
            self._role, self._header = [], []
            self._state = _State.BODY
            if _RECIPIENT in self._decode(frame):
                self._channel = Channel.CONTENT
                self._answered = True
                return [(Channel.CONTENT, i) for i in frame]
            self._channel = Channel.REASONING if header.startswith("analysis") else Channel.CONTENT
            self._swallow(len(frame))
            self._answered = self._answered or self._channel is Channel.CONTENT
            return [(None, i) for i in frame]
        self._header.append(token)
        if len(self._header) > _MAX_HEADER:  # not Harmony after all: the header is text
            role = self._role
            self._swallow(len(role))
            out: Released = [(None, i) for i in role] + [(Channel.CONTENT, i) for i in self._header]
            self._role, self._header = [], []
            self._state, self._channel = _State.BODY, Channel.CONTENT
            return out
        return []

    def _swallow(self, n: int) -> None:
        # Structure before the answer's message counts as thinking (it frames analysis
        # messages); after it, as the answer's.
        if not self._answered:
            self.reasoning_tokens += n

    def flush(self) -> Released:
        role, header = self._role, self._header if self._state is _State.HEADER else []
        self._swallow(len(role))
        out: Released = [(None, i) for i in role] + [(Channel.CONTENT, i) for i in header]
        self._role, self._header = [], []
        return out

    def forced(self) -> int | None:
        if self._forcing:
            return self._forcing[0]
        spent = self._budget is not None and self._spent >= self._budget
        if spent and self._state is _State.BODY and self._channel is Channel.REASONING:
            self._forcing = list(self._t.to_final)
            return self._forcing[0]
        return None

    def banned(self) -> int | None:
        return None
