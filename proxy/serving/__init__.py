"""The request path: from a dialect's parsed request to the bytes on the socket.

| module | what |
|---|---|
| ``serve`` | the one path every generation endpoint runs through (intake, limits, submit, delivery) |
| ``delivery`` | how a request's events reach its client: an SSE stream or one JSON body |
| ``lookups`` | questions the worker answers without generating (tokenize, detokenize) |
| ``side`` | the shared steps of the routes beside generation (``/tokenize``, ``count_tokens``) |
"""
