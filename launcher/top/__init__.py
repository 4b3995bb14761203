"""``exl3-sidecar top``: a live view of a server's ``GET /v1/status`` (``docs/status.md``).

- ``command``: the click command, options, exit status.
- ``client``: httpx + httpx-sse: one snapshot, or a stream of them; the error tree.
- ``model``: what the views show, from snapshots: rates between two of them, the
  sort orders, the words of each field.
- ``plain``: the view for pipes (a block of plain lines per snapshot).
- ``terminal``: the view for a terminal (rich: a header, a table with progress
  bars, keys to sort and quit).
"""

from launcher.top.command import top

__all__ = ["top"]
