"""Grammars for constrained decoding, built and checked at the HTTP edge.

The worker masks logits with an llguidance grammar (``SamplingParams.grammar``;
the CPU engine applies the matcher's token mask itself, ExLlamaV3 through its
``LLGuidanceFilter``). The proxy builds that grammar from the request and checks
it with llguidance's own validator (no tokenizer needed, well under a
millisecond), so a schema llguidance cannot compile is a 400 naming the field
before anything reaches the engine.

``response_format`` (OpenAI API reference): ``{"type": "text"}`` asks for
nothing; ``{"type": "json_object"}`` for any JSON object; ``{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}`` for JSON valid
against ``schema``.
"""

from __future__ import annotations

from llguidance import LLMatcher

from proxy.errors import InvalidRequest

ANY_JSON_OBJECT: dict[str, object] = {"type": "object"}
"""The schema of ``json_object`` outputs: any JSON object."""


def checked(grammar: str, param: str) -> str:
    """``grammar`` if llguidance accepts it; ``InvalidRequest`` naming ``param``
    with llguidance's message otherwise."""
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequest(f"'{param}' cannot be enforced: {error.strip()}", param=param)
    return grammar


def json_schema_grammar(schema: dict[str, object] | bool, param: str) -> str:
    """The grammar of JSON valid against ``schema``. Raises ``InvalidRequest``
    naming ``param`` for a schema llguidance cannot compile (unknown types,
    dangling ``$ref``, unsupported keywords)."""
    try:
        # A boolean schema (true: anything, false: nothing) goes as its JSON text.
        text_or_dict = schema if isinstance(schema, dict) else str(schema).lower()
        grammar = LLMatcher.grammar_from_json_schema(text_or_dict)
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"'{param}' cannot be enforced: {e}", param=param) from None
    return checked(grammar, param)
