"""The wire dialects the proxy speaks, one package each, over one core.

| package | route | |
|---|---|---|
| ``chat`` | ``POST /v1/chat/completions`` | OpenAI chat completions |
| ``completions`` | ``POST /v1/completions`` | OpenAI (legacy) text completions |
| ``responses`` | ``POST /v1/responses`` | OpenAI Responses API (stateless) |
| ``messages`` | ``POST /v1/messages``, ``/v1/messages/count_tokens`` | Anthropic Messages |

``proxy.core.dialect`` (the core's) says what a dialect provides (``Dialect``,
``Job``) and gets (``Context``, ``Header``); ``openai_common`` holds what the OpenAI dialects
share. ``registry.ROUTES`` is where they are mounted: adding a dialect is a
package exporting a ``Dialect`` and one line there.
"""
