"""Logging set-up shared by both processes: text lines or JSON lines on stderr.

``setup_logging(level, fmt)`` configures the root logger once per process.
``fmt="json"`` writes one JSON object per line (for log collectors such as
Fluent Bit or Loki): ``{"ts": float (Unix seconds), "level": str, "logger": str,
"message": str, ...}`` plus every key of the record's ``fields`` mapping (set
with ``log.info(msg, extra={"fields": {...}})``) at the top level. The text
format renders the same ``fields`` as ``key=value`` pairs after the message, so
one call site serves both formats.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, Literal

import orjson

LogFormat = Literal["text", "json"]

FIELDS = "fields"
"""The ``extra`` key whose mapping becomes structured fields of the line."""

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _fields(record: logging.LogRecord) -> Mapping[str, Any]:
    fields = getattr(record, FIELDS, None)
    return fields if isinstance(fields, Mapping) else {}


class TextFormatter(logging.Formatter):
    """The classic text line, with ``fields`` appended as ``key=value``."""

    def __init__(self) -> None:
        super().__init__(_TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = _fields(record)
        if not fields:
            return line
        pairs = " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        return f"{line} {pairs}"


def _text_value(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


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
