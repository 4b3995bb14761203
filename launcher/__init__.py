"""The ``exl3-sidecar`` command: starts the two processes, and a client to watch them.

- ``exl3-sidecar proxy``: the proxy's own command (``proxy.cli``), in this process.
- ``exl3-sidecar worker``: replaced by ``python -m engine_worker`` with the same
  arguments, so the worker's options, help and exit status are its own.
- ``exl3-sidecar serve``: both on one machine, the proxy in this process and the
  worker as a supervised child (``launcher.supervisor``).
- ``exl3-sidecar chat``: a terminal client for any OpenAI-compatible server
  (``launcher.chat``): queue position, prefill progress, answer, usage.
- ``exl3-sidecar top``: a live view of a server's ``GET /v1/status``
  (``launcher.top``): the worker's load and every request in flight.

| module | what |
|---|---|
| ``__main__`` | ``python -m launcher``: the CLI |
| ``cli`` | the ``exl3-sidecar`` commands (click) |
| ``supervisor`` | keeps the worker child running, restarting it as a pod would |
| ``wait`` | waiting for a server that is still starting, what ``chat`` and ``top`` do first |
| ``chat`` | ``exl3-sidecar chat``: the terminal client |
| ``top`` | ``exl3-sidecar top``: the live view of ``GET /v1/status`` |

This package imports ``proxy`` but never ``engine_worker``: it reaches the worker
only by its command line, so the process that serves HTTP maps no torch.
"""
