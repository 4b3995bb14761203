"""The OpenAI Responses API dialect: ``POST /v1/responses`` (stateless).

| module | what |
|---|---|
| ``request`` | the request body, its items and their ``ChatTask`` |
| ``shapes`` | the ``response`` object, output items, usage and stream events |
| ``frames`` | the stream encoder and the non-stream body |

``store`` is accepted and nothing is stored: ``previous_response_id`` is
refused (400 naming it) and ``GET /v1/responses/{id}`` answers 404, because a
store would keep every client's conversations in the proxy's memory; agents
that use this API statelessly (Codex CLI, the Agents SDK) send the whole
conversation each turn.

``POST /v1/responses/input_tokens`` (OpenAI's input token count) takes the same body
and answers ``{"object": "response.input_tokens", "input_tokens": int}``: the
``usage.input_tokens`` the same request to ``/v1/responses`` would report (template,
instructions, tools and the reasoning switch included), counted by the worker's
tokenizer, nothing generated.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from aiohttp import web

from protocol.messages import Submit
from proxy.core.dialect import Context, Dialect, Header, RequestJob, chat_submits
from proxy.core.generation import Frames, Generation, Options
from proxy.dialects.responses.frames import ResponsesFrames, responses_body
from proxy.dialects.responses.request import FIELDS, ResponsesRequest, parse_responses_request, responses_task
from proxy.dialects.responses.shapes import Reasoning, Response
from proxy.errors import OPENAI_ERRORS, NotFound
from proxy.server.bodies import encode
from proxy.serving.lookups import tokenize
from proxy.serving.serve import check_grammars
from proxy.serving.side import side_request


class ResponsesJob(RequestJob[ResponsesRequest]):
    """One Responses request."""

    __slots__ = ()

    def submits(self, request_id: str, context: Context) -> tuple[list[Submit], Options]:
        return chat_submits(responses_task(self.req), request_id, context)

    def snapshot(self, header: Header) -> Any:
        """``snapshot(status=..., output=..., ...)``: the response object with
        this request's parameters echoed."""
        req = self.req
        text_format: dict[str, object] = {"type": "text"}
        if req.text is not None and req.text.format is not None:
            text_format = {k: v for k, v in msgspec.structs.asdict(req.text.format).items() if v is not None}
        tools = [
            {k: v for k, v in msgspec.structs.asdict(t).items() if v is not None} for t in req.tools or ()
        ]
        tool_choice: object = req.tool_choice if req.tool_choice is not None else "auto"

        def build(**fields: Any) -> Response:
            return Response(
                id=header.id,
                created_at=header.created,
                model=header.model,
                instructions=req.instructions,
                max_output_tokens=req.max_output_tokens,
                parallel_tool_calls=req.parallel_tool_calls is not False,
                reasoning=Reasoning(
                    req.reasoning.effort if req.reasoning is not None else None,
                    req.reasoning.summary if req.reasoning is not None else None,
                ),
                store=False,
                temperature=req.temperature if req.temperature is not None else 1.0,
                text={"format": text_format},
                tool_choice=tool_choice,
                tools=list(tools),
                top_p=req.top_p if req.top_p is not None else 1.0,
                truncation=req.truncation or "disabled",
                metadata=dict(req.metadata or {}),
                **fields,
            )

        return build

    def frames(self, generation: Generation, header: Header) -> Frames:
        return ResponsesFrames(generation, header, self.snapshot(header), generation.options.logprobs)

    def body(self, generation: Generation, header: Header) -> bytes:
        return responses_body(generation, self.snapshot(header), generation.options.logprobs)


async def get_response(request: Any) -> Any:
    """``GET /v1/responses/{id}``: nothing is stored, so every id is unknown."""
    raise NotFound(
        "This server stores no responses ('store' is accepted and ignored); send the whole "
        "conversation as 'input' instead of retrieving or continuing a stored response",
        param="response_id",
        code="response_not_found",
    )


class InputTokens(msgspec.Struct, gc=False):
    input_tokens: int
    object: Literal["response.input_tokens"] = "response.input_tokens"


async def input_tokens(request: web.Request) -> web.Response:
    """``POST /v1/responses/input_tokens`` (module docstring); what ``/v1/responses``
    refuses for the same body is refused here the same way."""
    # The task is built with the parse (images decoded), in a thread for a large body.
    side = await side_request(request, lambda body: responses_task(parse_responses_request(body)))
    submits, _ = chat_submits(side.req, "count", side.context)
    await check_grammars(submits)
    ids = await tokenize(request, submits[0])
    return web.Response(body=encode(InputTokens(len(ids))), content_type="application/json")


RESPONSES = Dialect(
    name="responses",
    id_prefix="resp_",
    errors=OPENAI_ERRORS,
    parse=lambda body: ResponsesJob(parse_responses_request(body)),
    extra_routes=(
        ("POST", "/v1/responses/input_tokens", input_tokens),
        ("GET", "/v1/responses/{response_id}", get_response),
    ),
    fields=FIELDS,
)
"""``POST /v1/responses``, ``POST /v1/responses/input_tokens``; ``GET
/v1/responses/{response_id}`` is a 404."""
