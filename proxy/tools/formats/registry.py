"""The formats by name, template detection and the choice
``--tool-call-format`` makes (``auto`` or a name in ``FORMATS``). A new format
is a module beside this one and one entry in ``_ORDER``.

Detection looks at the chat template's source: each format's
``matches_template``, in ``_ORDER`` (llama.cpp's order for the first four:
``<tool_call>`` -> hermes; ``<|python_tag|>``, or the ``ipython`` role with
``"parameters"`` -> llama3_json; ``[TOOL_CALLS]`` -> mistral; ``<|channel|>``
with ``<|call|>`` -> harmony). A format's ``shadows`` are dropped when it
matches (a Qwen3-Coder template holds ``<tool_call>`` too, and is not Hermes).
When two formats still match, both are named in the log and the first is
taken unless ``--tool-call-format`` names one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import NamedTuple

from proxy.tools.formats.base import ToolCallFormat
from proxy.tools.formats.harmony import HARMONY
from proxy.tools.formats.hermes import HERMES
from proxy.tools.formats.llama3_json import LLAMA3_JSON
from proxy.tools.formats.mistral import MISTRAL

log = logging.getLogger(__name__)

_ORDER: tuple[ToolCallFormat, ...] = (HERMES, LLAMA3_JSON, MISTRAL, HARMONY)

FORMATS: Mapping[str, ToolCallFormat] = {f.name: f for f in _ORDER}
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


def detect_formats(template: str | None) -> tuple[ToolCallFormat, ...]:
    """Every format a chat template's source renders, in detection order, less
    those another match shadows; ``()`` when it mentions none (the template
    does not handle tools)."""
    if not template:
        return ()
    found = [fmt for fmt in FORMATS.values() if fmt.matches_template(template)]
    shadowed = {name for fmt in found for name in fmt.shadows}
    return tuple(fmt for fmt in found if fmt.name not in shadowed)


def detect_format(template: str | None) -> ToolCallFormat | None:
    """The first of ``detect_formats``, ``None`` when there is none."""
    found = detect_formats(template)
    return found[0] if found else None


class FormatChoice(NamedTuple):
    """``format`` parses the output; ``native``: the chat template renders tools
    and tool turns itself; else ``proxy.tools.render.render_fallback`` turns them
    into plain messages with a generic tools prompt in this format."""

    format: ToolCallFormat
    native: bool


def choose_format(setting: str, template: str | None) -> FormatChoice:
    """The format for a model from ``--tool-call-format`` (``auto`` or a name)
    and its chat template source. ``auto`` on a template that handles no tools
    (the embedded SmolLM2's) gives ``hermes`` with the generic prompt; on one
    that matches two formats, the first (logged with both names). Raises
    ``ValueError`` for an unknown name."""
    found = detect_formats(template)
    if setting == AUTO:
        if len(found) > 1:
            names = ", ".join(f.name for f in found)
            log.warning(
                "the chat template matches the tool-call formats %s; using %s "
                "(--tool-call-format names another)",
                names,
                found[0].name,
            )
        return FormatChoice(found[0] if found else HERMES, bool(found))
    return FormatChoice(get_format(setting), bool(found))
