"""Logging set-up shared by both processes: text lines or JSON lines on stderr.

``setup_logging(level, fmt)`` configures the root logger once per process.
``fmt="json"`` writes one JSON object per line (for log collectors such as
Fluent Bit or Loki): ``{"ts": float (Unix seconds), "level": str, "logger": str,
"message": str, ...}`` plus every key of the record's ``fields`` mapping (set
with ``log.info(msg, extra={"fields": {...}})``) at the top level. The text
format renders the same ``fields`` as ``key=value`` pairs after the message, so
one call site serves both formats.

Text lines are one line per record whatever a client sent: the message and the
field values (a request path, a header, a model name, an error quoting input)
have their control characters escaped (``escape_controls``: a line feed becomes
a backslash and ``n``, ESC a backslash and ``x1b``), so a client can neither
forge a record nor send terminal escape sequences to whoever reads the log. A
traceback keeps its line breaks, but each of its lines is indented by
``TRACEBACK_INDENT`` with its other control characters escaped: only a record's
first line starts at column 0. (JSON lines need nothing: JSON escapes control
characters.)
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from typing import Any, Literal

import orjson

LogFormat = Literal["text", "json"]

FIELDS = "fields"
"""The ``extra`` key whose mapping becomes structured fields of the line."""

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

TRACEBACK_INDENT = "    "
"""Prefix of every line of a traceback (or stack) in a text log record."""

_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
"""C0 and C1 controls, DEL, and the Unicode line and paragraph separators (which
some log viewers break lines at)."""

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    c = match.group()
    named = _NAMED.get(c)
    if named is not None:
        return named
    return f"\\x{ord(c):02x}" if ord(c) <= 0xFF else f"\\u{ord(c):04x}"


def escape_controls(text: str) -> str:
    """``text`` with every control character (``_CONTROLS``) written as a
    backslash escape (``\\n``, ``\\r``, ``\\t``, ``\\xNN``, ``\\uNNNN``), so it
    fits on one line and drives no terminal."""
    return _CONTROLS.sub(_escaped, text)


def _fields(record: logging.LogRecord) -> Mapping[str, Any]:
    fields = getattr(record, FIELDS, None)
    return fields if isinstance(fields, Mapping) else {}


class TextFormatter(logging.Formatter):
    """The classic text line, with ``fields`` appended as ``key=value``, control
    characters escaped and tracebacks indented (module docstring).

    ``format`` is ``logging.Formatter.format`` with those two steps; it does not
    store the traceback text in ``record.exc_text``, which other handlers of the
    same record read."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        fields = _fields(record)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + _indented(self.formatException(record.exc_info))
        elif record.exc_text:
            line += "\n" + _indented(record.exc_text)
        if record.stack_info:
            line += "\n" + _indented(self.formatStack(record.stack_info))
        return line


def _indented(text: str) -> str:
    return "\n".join(TRACEBACK_INDENT + escape_controls(line) for line in text.splitlines())


def _text_value(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return escape_controls(str(v))


class JsonFormatter(logging.Formatter):
    """One JSON object per record (module docstring), encoded by orjson."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        doc.update(_fields(record))
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


def setup_logging(level: str, fmt: LogFormat = "text") -> None:
    """Send log records at ``level`` and above to stderr in ``fmt``; replaces any
    handler the root logger had (the CLI calls it once, before anything logs).
    With ``json`` it also turns tqdm progress bars off (``TQDM_DISABLE``), so
    every stderr line of the process is JSON."""
    if fmt == "json":
        # Progress bars (tqdm: transformers' weight loading, hub downloads) write
        # raw text lines into the same stderr a log collector reads as JSON.
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
