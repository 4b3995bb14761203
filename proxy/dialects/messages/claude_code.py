"""Claude Code's billing block, kept out of the prompt.

Claude Code (2.1.x) sends, as the first block of ``system``, a line of billing
metadata for Anthropic's own API::

    {"type": "text",
     "text": "x-anthropic-billing-header: cc_version=2.1.37.0d9; cc_entrypoint=cli; cch=fa690;"}

It is no text for the model, and some versions put a per-request stamp in it
(``cch=``). Tokenized first, a stamp that changes on every request makes every
prompt differ from its first tokens on, so the prefix cache never holds across
turns (issue 30 measured it: two 658-token Messages requests, identical but for
the stamp, reported ``cache_read_input_tokens: 0`` on the second). So the line is dropped before the prompt is
built, as llama.cpp does (ggml-org/llama.cpp pull request 20623: a system block
starting ``x-anthropic-`` is not added to the prompt; ik_llama.cpp pull request
1436 and SGLang pull request 21064 do the same for the same reason).

Only that line, only where Claude Code puts it: the start of the first system
block (or of a string ``system``); a block left empty is dropped. Text anywhere
else, a user's message quoting the header included, is the client's and stays.
"""

from __future__ import annotations

from collections.abc import Mapping

BILLING_HEADER = "x-anthropic-billing-header:"


def _without_first_line(text: str) -> str:
    _, _, rest = text.partition("\n")
    return rest


def without_billing_header(system: object) -> object:
    """``system`` (a string or a list of blocks, as decoded) without Claude Code's
    billing line (module docstring); anything else unchanged."""
    if isinstance(system, str):
        return _without_first_line(system) if system.startswith(BILLING_HEADER) else system
    if not isinstance(system, list) or not system:
        return system
    first = system[0]
    if not isinstance(first, Mapping) or first.get("type") != "text":
        return system
    text = first.get("text")
    if not isinstance(text, str) or not text.startswith(BILLING_HEADER):
        return system
    rest = _without_first_line(text)
    if not rest:
        return system[1:]
    return [{**first, "text": rest}, *system[1:]]
