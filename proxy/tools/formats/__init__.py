"""The tool-call formats models write, one module each, over one contract.

| module | what |
|---|---|
| ``base`` | ``ToolCallFormat``, the ``CallBlock`` contract (``advance``, ``progress``), ids |
| ``objects`` | JSON call objects ``{"name", "arguments"}``, whole and streamed |
| ``hermes`` | ``<tool_call>{json}</tool_call>`` (Hermes, Qwen 2.5/3) |
| ``llama3_json`` | ``<|python_tag|>`` / bare ``{"name", "parameters"}`` (Llama 3.x) |
| ``mistral`` | ``[TOOL_CALLS]`` arrays and ``name[ARGS]{...}`` (Mistral) |
| ``harmony`` | ``to=functions.NAME`` message frames (GPT-OSS) |
| ``registry`` | ``FORMATS``, detection from a chat template, ``--tool-call-format`` |

Markers are text here: the worker must detokenize marker tokens that are
special tokens in the model's vocabulary (``[TOOL_CALLS]``, ``<|python_tag|>``)
rather than skip them, or the parser never sees them (vLLM turns
``skip_special_tokens`` off for Mistral for this reason).
"""

from proxy.tools.formats.base import (
    BlockOutcome,
    BlockProgress,
    CallBlock,
    StreamingCall,
    ToolCallFormat,
    Tools,
)
from proxy.tools.formats.harmony import HARMONY
from proxy.tools.formats.hermes import HERMES
from proxy.tools.formats.llama3_json import LLAMA3_JSON
from proxy.tools.formats.mistral import MISTRAL
from proxy.tools.formats.registry import (
    AUTO,
    FORMATS,
    TOOL_CALL_FORMAT_CHOICES,
    FormatChoice,
    choose_format,
    detect_format,
    detect_formats,
    get_format,
)

__all__ = [
    "AUTO",
    "FORMATS",
    "HARMONY",
    "HERMES",
    "LLAMA3_JSON",
    "MISTRAL",
    "TOOL_CALL_FORMAT_CHOICES",
    "BlockOutcome",
    "BlockProgress",
    "CallBlock",
    "FormatChoice",
    "StreamingCall",
    "ToolCallFormat",
    "Tools",
    "choose_format",
    "detect_format",
    "detect_formats",
    "get_format",
]
