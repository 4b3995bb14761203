"""The request fields chat and text completions share (OpenAI API reference).

``OpenAIFields`` is ``proxy.core.fields.SamplerFields`` plus what both OpenAI
endpoints define: ``max_tokens``, ``stop``, ``n``, ``stream_options``,
``response_format`` and llama.cpp's ``timings_per_token``. Errors:
``proxy.errors.InvalidRequest`` naming the field.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from proxy.core.fields import Count, SamplerFields, json_output
from proxy.core.task import JsonOutput


class StreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: ``include_usage`` adds one last chunk with ``choices: []``
    and the usage; ``continuous_usage_stats`` (vLLM) adds running usage to every
    chunk (only together with ``include_usage``)."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ImageUrl(msgspec.Struct, kw_only=True):
    """An ``image_url`` part's image: a data URL (``proxy.core.images``); ``detail``
    is accepted and changes nothing: the model's own image processor decides the
    resolution it sees."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's ``content`` list: ``text``, or ``image_url`` (user turns)."""

    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``: ``schema`` is the JSON schema the output
    must match; ``strict`` is accepted (the output always matches when the
    grammar can express the schema; one it cannot is refused with a 400)."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, object] | bool | None = None
    strict: bool | None = None


class ResponseFormatIn(msgspec.Struct, kw_only=True):
    """``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class OpenAIFields(SamplerFields, kw_only=True):
    """The fields chat and text completions share (module docstring)."""

    max_tokens: Count | None = None
    stop: str | list[str] | None = None
    n: Count = 1  # capped by ProxySettings.max_n where the request is served
    stream_options: StreamOptions | None = None
    response_format: ResponseFormatIn | None = None
    timings_per_token: bool = False  # llama.cpp: its ``timings`` object on every chunk

    @property
    def include_usage(self) -> bool:
        """Streaming: send the usage chunk at the end."""
        return self.stream and self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Streaming: running usage on every chunk (vLLM's extension)."""
        return (
            self.include_usage
            and self.stream_options is not None
            and bool(self.stream_options.continuous_usage_stats)
        )

    def json_output(self) -> JsonOutput | None:
        """The JSON output ``response_format`` asks for, ``None`` for none."""
        rf = self.response_format
        if rf is None:
            return None
        schema = rf.json_schema
        return json_output(
            rf.type,
            None if schema is None else schema.schema,
            param="response_format",
            schema_param="response_format.json_schema",
            strict=bool(schema is not None and schema.strict),
        )
