"""The wire dialects the proxy speaks, one package each, over one core.

| module | what |
|---|---|
| ``chat`` | OpenAI chat completions: ``POST /v1/chat/completions`` |
| ``completions`` | OpenAI (legacy) text completions: ``POST /v1/completions`` |
| ``responses`` | the OpenAI Responses API (stateless): ``POST /v1/responses``, ``input_tokens`` |
| ``messages`` | Anthropic Messages: ``POST /v1/messages``, ``/v1/messages/count_tokens`` |
| ``tabby`` | TabbyAPI's read routes and llama.cpp's ``GET /props``, for SillyTavern |
| ``openai`` | what chat and completions share: fields, usage and logprobs shapes, chunks |
| ``registry`` | ``ROUTES``: where each dialect is mounted |

``proxy.core.dialect`` (the core's) says what a dialect provides (``Dialect``,
``Job``) and gets (``Context``, ``Header``); ``openai`` holds what the OpenAI dialects
share. ``registry.ROUTES`` is where they are mounted: adding a dialect is a
package exporting a ``Dialect`` and one line there.
"""
