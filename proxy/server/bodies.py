"""The JSON bodies of the routes that belong to no dialect, and ``encode``.

Every body is a ``msgspec.Struct`` encoded once by ``encode``. Field order is
key order on the wire, so never reorder fields; a field set to
``msgspec.UNSET`` is left out, ``None`` is written as ``null``. The generation
endpoints' bodies are their dialect's (``proxy.dialects``).

The error envelope of these routes is OpenAI's (``proxy.errors.ErrorEnvelope``).

Models: ``{"object": "list", "data": [card]}`` with card ``{"id": str, "object":
"model", "created": int, "owned_by": "exl3-sidecar", "max_model_len": int,
"architecture": {"input_modalities": ["text"] | ["text", "image"],
"output_modalities": ["text"]}}`` (``max_model_len``, vLLM's name for the
context size, and ``architecture``, OpenRouter's, only once the worker's
handshake is known); ``GET /v1/models/{id}`` answers any name with that id and
``"root": <the served model>``. Probes: ``/health`` ``{"status": "ok"}``; ``/ready``
``{"status": "ready", "model": str | null, "worker_active_requests": int | null,
"worker_waiting_requests": int | null, "worker_kv_cache_usage": float | null}``
or ``{"status": "not_ready" | "draining"}``.
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

encode = msgspec.json.Encoder().encode
"""One JSON body (no SSE framing, no line-separator escaping: a complete
response body is never split into lines by a client)."""


class Architecture(msgspec.Struct, kw_only=True, gc=False):
    """A model card's ``architecture`` (OpenRouter's shape, which model pickers read):
    what the model reads (``text``, ``image``: ``Ready.modalities``) and writes."""

    input_modalities: list[str]
    output_modalities: list[str] = msgspec.field(default_factory=lambda: ["text"])


class ModelCard(msgspec.Struct, kw_only=True, gc=False):
    """One entry of ``/v1/models``; ``max_model_len`` is vLLM's name for the
    context size, which clients use to size prompts."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "exl3-sidecar"
    max_model_len: int | UnsetType = UNSET
    root: str | UnsetType = UNSET
    architecture: Architecture | UnsetType = UNSET


class ModelList(msgspec.Struct, kw_only=True, gc=False):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthStatus(msgspec.Struct, gc=False):
    status: Literal["ok"] = "ok"


class LoadingStage(msgspec.Struct, gc=False):
    """``/ready``'s ``loading``: the worker's load stage (``protocol.messages.Loading``):
    ``stage`` and its ``label``, ``done`` of ``total`` (``total`` 0: not counted),
    seconds in the stage (``elapsed_s``) and since the load began (``load_s``)."""

    stage: str
    label: str
    done: int
    total: int
    elapsed_s: float
    load_s: float


class ReadyStatus(msgspec.Struct, gc=False):
    """``/ready``: ``model`` and the worker's load (its latest heartbeat: running
    and waiting requests, KV cache usage 0..1) only when ready; ``loading`` (the
    stage) while a worker loads its model."""

    status: Literal["ready", "not_ready", "loading", "draining"]
    model: str | UnsetType | None = UNSET
    worker_active_requests: int | UnsetType | None = UNSET
    worker_waiting_requests: int | UnsetType | None = UNSET
    worker_kv_cache_usage: float | UnsetType | None = UNSET
    loading: LoadingStage | UnsetType = UNSET
