"""What every backend reads the same way out of a ``Submit``: the conversation as a
chat template takes it, and the request's thinking budget."""

from __future__ import annotations

import json
from typing import Any

from engine_worker.backend import RequestRejected
from protocol.messages import ErrorCode, SamplingParams, Submit


def thinking_budget(params: SamplingParams, default: int | None) -> int | None:
    """Thinking tokens the request may spend: its own ``reasoning_budget``, else the
    worker's ``--reasoning-budget`` (``default``); ``None``: no limit."""
    return params.reasoning_budget if params.reasoning_budget is not None else default


def template_turns(submit: Submit, tool_fields: bool) -> list[dict[str, Any]]:
    """``Submit.messages`` as chat templates read them: ``role``, ``content``, a turn's
    thinking under both names templates use (``reasoning_content``: Qwen3, DeepSeek;
    ``thinking``: GPT-OSS), and with ``tool_fields`` its ``tool_calls`` (decoded),
    ``tool_call_id`` and ``name``. Raises ``RequestRejected`` (``messages``) for
    ``tool_calls`` that are not JSON."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(submit.messages):
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        if tool_fields:
            if m.tool_calls_json is not None:
                try:
                    turn["tool_calls"] = json.loads(m.tool_calls_json)
                except ValueError as e:
                    raise RequestRejected(
                        ErrorCode.INVALID_REQUEST, f"messages[{i}].tool_calls: not JSON: {e}", "messages"
                    ) from e
            if m.tool_call_id is not None:
                turn["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                turn["name"] = m.name
        if m.reasoning is not None:
            turn["reasoning_content"] = turn["thinking"] = m.reasoning
        out.append(turn)
    return out
