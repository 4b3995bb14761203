"""Shared tool definitions for the ``proxy.tools`` tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from proxy.tools.spec import ToolChoiceIn, ToolConfig, ToolIn, resolve_tools

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"],
}

TOOLS_JSON: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMS},
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def tools_in(raw: list[dict[str, Any]]) -> list[ToolIn]:
    """``tools`` decoded as the request layer decodes it."""
    return msgspec.convert(raw, list[ToolIn])


def config(choice: ToolChoiceIn | dict[str, Any] | None = None, parallel: bool | None = None) -> ToolConfig:
    """The ``ToolConfig`` of ``TOOLS_JSON`` with this ``tool_choice``/``parallel_tool_calls``."""
    decoded = msgspec.convert(choice, ToolChoiceIn | None) if isinstance(choice, dict) else choice
    resolved = resolve_tools(tools_in(TOOLS_JSON), decoded, parallel)
    assert resolved is not None
    return resolved


def counter_ids() -> Callable[[], str]:
    """Deterministic call ids: call_0, call_1, ..."""
    numbers: Iterator[int] = iter(range(1_000_000))
    return lambda: f"call_{next(numbers)}"


@pytest.fixture
def auto() -> ToolConfig:
    return config()
