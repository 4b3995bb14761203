"""The engine worker process: owns the model and pushes generation events over ZeroMQ.

Laid out by layer, top to bottom (the ``[tool.importlinter]`` contract "the worker's
layers" keeps every import pointing down). A new engine is one package beside
``cpu`` and ``exllamav3`` implementing ``backend.Backend``, and one line in
``main.make_backend``.

| module | what |
|---|---|
| ``__main__`` | ``python -m engine_worker``: the CLI |
| ``probe`` | the Kubernetes probes of the worker container (``python -m engine_worker.probe``) |
| ``cli`` | the command line, from ``settings.WorkerSettings`` |
| ``main`` | the process: load the backend (announcing the stages), sockets, KV events, the loop |
| ``loop`` | the engine loop: receive, validate, prepare, queue, admit, step, send; dispatch only |
| ``heartbeat`` | heartbeats from a thread of their own, and the beat file |
| ``lookups`` | ``Tokenize``/``Detokenize``, answered on a thread of their own |
| ``waiting`` | the admission queue: FIFO with backfilling, ``QueueProgress`` and its ETA |
| ``cpu`` | the CPU engine: a torch forward pass of Llama-family models, the embedded model |
| ``exllamav3`` | the ExLlamaV3 engine on CUDA |
| ``synthetic`` | a model-less engine for load and fault tests |
| ``admission`` | every request's checks, once, by the backend's ``ModelInfo``; its completion budget |
| ``requests`` | one request's lifecycle every backend feeds: choices, turns, the output pipeline |
| ``reasoning`` | thinking kept apart from the answer, by model family |
| ``constraints`` | grammars (llguidance) over a vocabulary, the token mask per step |
| ``client_text`` | client text never becomes a control token: template output split by its control tokens |
| ``load_stages`` | the stages of a model load, announced to the proxy as ``Loading`` |
| ``kv_events`` | the prefix cache's blocks as KV-cache events (vLLM's ZMQ format, for llm-d) |
| ``sockets`` | the worker's ZeroMQ sockets |
| ``backend`` | the contract between the loop and a backend: ``Backend``, ``ModelInfo``, ``Prepared`` |
| ``settings`` | every option of the worker, written once (``WorkerSettings``) |
| ``options`` | what constrains the options: engine limits, the checks that read the disk |
"""
