"""Compare ``/metrics`` with the usage clients were sent, on a running server.

Sends a short mix (chat and text, stream and not, ``n`` 1 and 2, a repeated
prompt for prefix-cache hits, a repetitive one for n-gram drafts), sums the
``usage`` of every response, scrapes ``/metrics`` before and after, and prints
both with the prefix-cache hit ratio and the draft acceptance rate computed
from each. Start the server with drafting to see draft counters::

    exl3-sidecar serve --port 5056 -- --draft-mode ngram
    python scripts/metrics_vs_usage.py http://127.0.0.1:5056

It needs only the base install (httpx, orjson, prometheus-client). The repeated
prompt is about 640 tokens, so its second request (``n`` 1, which runs under any
``--max-batch-size``) finds two whole 256-token prompt chunks of the first in the
prefix cache (the CPU engine keeps whole chunks: ``--chunk-size``). A request the
server refuses (``n`` 2 under ``--max-batch-size 1`` is a 400) is printed with the
server's message and left out of both sums; the counters count only what clients
were sent.
"""

from __future__ import annotations

import sys
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = {
    "prompt": "prompt_tokens_total",
    "cached": "prompt_tokens_cached_total",
    "completion": "generation_tokens_total",
    "accepted": "draft_tokens_accepted_total",
    "rejected": "draft_tokens_rejected_total",
}
REPEAT = "Repeat exactly: " + "one two three four five six seven eight nine ten " * 60
MIX: list[tuple[dict[str, Any], bool]] = [
    ({"messages": [{"role": "user", "content": "Write a haiku about rivers."}], "max_tokens": 24}, False),
    ({"messages": [{"role": "user", "content": "Write a haiku about rivers."}], "max_tokens": 24}, True),
    ({"messages": [{"role": "user", "content": REPEAT}], "max_tokens": 60, "temperature": 0}, True),
    # the same prompt again, alone: its whole 256-token chunks come from the prefix cache
    ({"messages": [{"role": "user", "content": REPEAT}], "max_tokens": 8, "temperature": 0}, False),
    ({"messages": [{"role": "user", "content": REPEAT}], "max_tokens": 60, "temperature": 0, "n": 2}, False),
    ({"prompt": "Once upon a time", "max_tokens": 16}, True),
    ({"prompt": "Once upon a time", "max_tokens": 16, "n": 2}, False),
]


def counters(base: str) -> dict[str, float]:
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(httpx.get(base + "/metrics").text)
        for s in family.samples
        if not s.labels
    }
    return {key: samples.get("exl3_sidecar_" + name, 0.0) for key, name in COUNTERS.items()}


class Refused(Exception):
    """The server answered with an error: its status and message."""


def _message(raw: bytes) -> str:
    try:
        error = orjson.loads(raw)["error"]
        return f"{error.get('message')} ({error.get('code') or error.get('type')})"
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return raw.decode(errors="replace")[:300]


def usage_of(client: httpx.Client, base: str, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """The response's ``usage``. Raises ``Refused`` with the server's message."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body = {**body, "model": "any", "stream": stream}
    if not stream:
        r = client.post(base + path, json=body)
        if r.status_code >= 400:
            raise Refused(f"{path}: {r.status_code} {_message(r.content)}")
        usage: dict[str, Any] = r.json()["usage"]
        return usage
    body["stream_options"] = {"include_usage": True}
    with client.stream("POST", base + path, json=body) as r:
        if r.status_code >= 400:
            raise Refused(f"{path}: {r.status_code} {_message(r.read())}")
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    for chunk in data:
        if chunk.startswith("{") and '"error"' in chunk[:12]:  # an error event after the stream began
            raise Refused(f"{path}: {_message(chunk.encode())}")
    return dict(orjson.loads(data[-2])["usage"])  # the last chunk before [DONE]


def ratios(t: dict[str, float]) -> str:
    drafted = t["accepted"] + t["rejected"]
    hit = t["cached"] / t["prompt"] if t["prompt"] else 0.0
    return f"hit ratio {hit:.4f}, acceptance {t['accepted'] / drafted if drafted else 0.0:.4f}"


def main(base: str) -> None:
    before = counters(base)
    sent = dict.fromkeys(COUNTERS, 0)
    with httpx.Client(timeout=300) as client:
        for body, stream in MIX:
            try:
                u = usage_of(client, base, body, stream)
            except Refused as e:
                print("refused by the server:", e)
                continue
            details = u.get("completion_tokens_details") or {}
            sent["prompt"] += u["prompt_tokens"]
            sent["cached"] += u["prompt_tokens_details"]["cached_tokens"]
            sent["completion"] += u["completion_tokens"]
            sent["accepted"] += details.get("accepted_prediction_tokens", 0)
            sent["rejected"] += details.get("rejected_prediction_tokens", 0)
    after = counters(base)
    deltas = {k: after[k] - before[k] for k in COUNTERS}
    print("clients' usage summed:", sent, "->", ratios({k: float(v) for k, v in sent.items()}))
    print("counter deltas:       ", deltas, "->", ratios(deltas))


if __name__ == "__main__":
    url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:5000"
    try:
        main(url)
    except httpx.TransportError as e:
        sys.exit(f"cannot reach {url}: {e}")
