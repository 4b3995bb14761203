"""engine_worker.constraints on the embedded model's tokenizer: the vocabulary as
llguidance sees it, compiling grammars (errors name the request field), and one
sequence's mask, consumption and draft checks. Expectations come from the
tokenizer itself, not from llguidance."""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")
llguidance = pytest.importorskip("llguidance")
pytest.importorskip("transformers")

from engine_worker.backend import RequestRejected  # noqa: E402
from engine_worker.constraints import (  # noqa: E402
    GrammarUnsupported,
    TokenConstraint,
    Vocabulary,
    compile_grammar,
    grammar_failure,
)
from protocol.messages import ErrorCode  # noqa: E402
from tests.fakes.cpu import load_tokenizer_embedded  # noqa: E402

END_IDS = (0, 2)  # <|endoftext|>, <|im_end|> in SmolLM2's vocabulary


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    return load_tokenizer_embedded()


@pytest.fixture(scope="module")
def vocabulary(hf_tokenizer: Any) -> Vocabulary:
    vocab = Vocabulary(len(hf_tokenizer), END_IDS)
    vocab.load(hf_tokenizer)
    return vocab


def ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def constraint(vocabulary: Vocabulary, hf_tokenizer: Any, grammar: str) -> TokenConstraint:
    matcher = compile_grammar(vocabulary.load(hf_tokenizer), grammar, "response_format")
    return TokenConstraint(matcher, vocabulary.vocab_size, "response_format")


def test_vocabulary_is_built_once_and_knows_token_bytes(vocabulary, hf_tokenizer) -> None:
    first = vocabulary.load(hf_tokenizer)
    assert vocabulary.load(object()) is first  # later calls reuse it, whatever they pass
    newline = hf_tokenizer.convert_tokens_to_ids("Ċ")  # byte-level BPE's spelling of "\n"
    assert vocabulary.token_bytes(newline) == b"\n"
    assert vocabulary.token_bytes(2) == b"<|im_end|>"
    text = "naïve 東京 🦙"
    assert b"".join(vocabulary.token_bytes(i) for i in ids(hf_tokenizer, text)) == text.encode()


def test_vocabulary_of_an_unusable_tokenizer_says_so() -> None:
    vocab = Vocabulary(10, [1])
    for _ in range(2):  # the failure is remembered, not retried
        with pytest.raises(GrammarUnsupported, match="cannot be used with grammars"):
            vocab.load(object())
    assert not vocab.loaded


def test_vocabulary_load_from_two_threads_builds_one(hf_tokenizer) -> None:
    vocab = Vocabulary(len(hf_tokenizer), END_IDS)
    copies = [hf_tokenizer, load_tokenizer_embedded()]  # each thread its own tokenizer
    built: list[Any] = []
    threads = [threading.Thread(target=lambda t=t: built.append(vocab.load(t))) for t in copies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 2 and built[0] is built[1]


@pytest.mark.parametrize(
    "grammar",
    [
        "start: foo(",  # Lark syntax error
        llguidance.LLMatcher.grammar_from_json_schema({"type": "strin"}),  # no such JSON type
        llguidance.LLMatcher.grammar_from_json_schema({"$ref": "#/nowhere"}),
        "",
    ],
)
def test_bad_grammar_is_rejected_with_its_field(vocabulary, hf_tokenizer, grammar) -> None:
    with pytest.raises(RequestRejected) as exc:
        compile_grammar(vocabulary.load(hf_tokenizer), grammar, "response_format")
    assert exc.value.code is ErrorCode.INVALID_REQUEST
    assert exc.value.param == "response_format"
    assert exc.value.message.startswith("invalid grammar: ")


def test_mask_allows_exactly_the_grammar_prefixes(vocabulary, hf_tokenizer) -> None:
    c = constraint(vocabulary, hf_tokenizer, 'start: "yes" | "no"')
    forbidden = c.forbidden()
    assert forbidden.shape == (vocabulary.vocab_size,) and forbidden.dtype == torch.bool
    allowed = set(torch.nonzero(~forbidden).flatten().tolist())
    # Byte-level BPE spells ASCII letters as themselves: the tokens that start an answer.
    special = set(hf_tokenizer.all_special_ids)
    pieces = hf_tokenizer.convert_ids_to_tokens(list(range(vocabulary.vocab_size)))
    expected = {
        i
        for i, piece in enumerate(pieces)
        if piece and i not in special and ("yes".startswith(piece) or "no".startswith(piece))
    }
    assert allowed == expected
    assert {hf_tokenizer.convert_tokens_to_ids(t) for t in ("yes", "no")} <= allowed


def test_consume_until_complete_then_only_end_tokens(vocabulary, hf_tokenizer) -> None:
    c = constraint(vocabulary, hf_tokenizer, 'start: "The answer is " ("yes" | "no") "."')
    answer = ids(hf_tokenizer, "The answer is no.")
    for token in answer[:-1]:
        assert not bool(c.forbidden()[token])
        c.consume(token)
        assert not c.stopped
    c.consume(answer[-1])
    assert c.stopped
    assert torch.nonzero(~c.forbidden()).flatten().tolist() == list(END_IDS)


def test_valid_prefix_checks_drafts_without_consuming(vocabulary, hf_tokenizer) -> None:
    c = constraint(vocabulary, hf_tokenizer, 'start: "one two three four"')
    good = ids(hf_tokenizer, "one two three")
    bad = ids(hf_tokenizer, " five")
    assert c.valid_prefix(good + bad) == len(good)
    assert c.valid_prefix([]) == 0
    assert c.valid_prefix(bad) == 0
    c.consume(good[0])  # nothing was consumed by the checks
    assert c.valid_prefix(good[1:]) == len(good) - 1


def test_consuming_a_forbidden_token_fails_with_the_field(vocabulary, hf_tokenizer) -> None:
    c = constraint(vocabulary, hf_tokenizer, 'start: "yes"')
    with pytest.raises(RequestRejected) as exc:
        c.consume(ids(hf_tokenizer, "no")[0])
    assert exc.value.code is ErrorCode.INVALID_REQUEST and exc.value.param == "response_format"
    assert exc.value.message.startswith("grammar failed while decoding: ")


def test_compiled_matcher_copies_are_independent(vocabulary, hf_tokenizer) -> None:
    matcher = compile_grammar(vocabulary.load(hf_tokenizer), 'start: "ab" | "cd"', None)
    a = TokenConstraint(matcher.deep_copy(), vocabulary.vocab_size, None)
    b = TokenConstraint(matcher.deep_copy(), vocabulary.vocab_size, None)
    a_token = hf_tokenizer.convert_tokens_to_ids("ab")
    a.consume(a_token)
    assert a.stopped and not b.stopped
    assert not bool(b.forbidden()[a_token])


def test_a_grammar_failure_tells_the_reason_not_the_parser_state() -> None:
    dump = "NoExtensionBias\n<state>\nTokens: [tool_call]\n<grammar>\nstart: %json {...}\n"
    message = grammar_failure(dump)
    assert message.startswith("grammar failed while decoding: NoExtensionBias")
    assert "<state>" not in message and "<grammar>" not in message and "Tokens" not in message
    assert "$ref" in message  # the likely cause, for a grammar that allows nothing more
    assert grammar_failure("") == "grammar failed while decoding: unknown error"
