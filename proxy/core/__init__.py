"""What every dialect's request goes through, written once: no dialect is named here.

| module | what |
|---|---|
| ``dialect`` | the contract: what a dialect provides (``Dialect``, ``Job``, ``FieldNames``) and gets |
| ``fields`` | tolerant body decoding, field types, the sampler fields and the one sampling builder |
| ``images`` | image parts of every dialect: decoded, then limits and a full decode checked in a thread |
| ``image_fetch`` | http(s) image URLs, fetched where allowed, from a private address only if listed |
| ``task`` | the neutral task (``ChatTask``/``TextTask``) and its conversion into ``Submit``s |
| ``generation`` | one response's state, fed by the worker's events |
| ``samplers`` | the local-LLM sampler vocabulary: each sampler field, its aliases, range and default |
| ``progress`` | this server's ``prompt_progress`` and ``queue_progress`` shapes |
| ``usage`` | one accounting (``Counts``) for every usage shape, the log and the metrics |
"""
