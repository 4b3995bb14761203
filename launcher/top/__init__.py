"""``exl3-sidecar top``: a live view of a server's ``GET /v1/status`` (``docs/status.md``).

| module | what |
|---|---|
| ``command`` | the click command, options, exit status |
| ``client`` | httpx + httpx-sse: one snapshot, or a stream of them; the error tree |
| ``model`` | what the views show: rates between two snapshots, the sort orders, the words |
| ``plain`` | the view for pipes (a block of plain lines per snapshot) |
| ``terminal`` | the view for a terminal (rich: a header, a table with progress bars, keys) |
"""

from launcher.top.command import top

__all__ = ["top"]
