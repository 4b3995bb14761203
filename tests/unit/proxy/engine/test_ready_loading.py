"""``GET /ready`` while the worker loads its model: 503 with the stage its
``Loading`` messages name, ``not_ready`` when nothing says it loads."""

from __future__ import annotations

from protocol import Loading
from tests.fakes.engine_client import FakeEngineClient
from tests.unit.proxy.conftest import MakeClient


async def test_ready_names_the_load_stage(make_client: MakeClient, fake: FakeEngineClient) -> None:
    fake.is_ready = False
    client = await make_client()
    r = await client.get("/ready")
    assert r.status == 503 and await r.json() == {"status": "not_ready"}
    fake.loading = Loading("w1", "quantize", "quantize weights (int4)", 12, 30, 1540, 4260)
    r = await client.get("/ready")
    assert r.status == 503
    assert await r.json() == {
        "status": "loading",
        "loading": {
            "stage": "quantize",
            "label": "quantize weights (int4)",
            "done": 12,
            "total": 30,
            "elapsed_s": 1.5,
            "load_s": 4.3,
        },
    }
    fake.is_ready, fake.loading = True, None
    r = await client.get("/ready")
    assert r.status == 200 and (await r.json())["status"] == "ready"
