"""What the two OpenAI completion dialects share: chat (``proxy.dialects.chat``)
and text completions (``proxy.dialects.completions``).

| module | what |
|---|---|
| ``request`` | ``OpenAIFields``: the request fields both take, over ``proxy.core.fields`` |
| ``shapes`` | usage, logprobs, llama.cpp's ``timings``, the chunk and the body |
| ``frames`` | ``ChunkFrames``: the ``data:``-only stream encoder and its ``[DONE]`` |
"""
