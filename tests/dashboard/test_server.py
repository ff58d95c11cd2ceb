"""The dashboard's HTTP server on a real loopback socket, with a scripted data source."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from bigfleet.dashboard import DashboardServer
from bigfleet.dashboard.server import split_hostport


class ScriptedSource:
    component = "shard"

    def __init__(self) -> None:
        self.calls = 0
        self.fail = False

    async def snapshot(self, now: float) -> dict[str, Any]:
        self.calls += 1
        if self.fail:
            raise RuntimeError("boom")
        return {"component": "shard", "id": "s1", "calls": self.calls, "now": now}


async def test_serves_page_assets_and_json() -> None:
    src = ScriptedSource()
    clock = [42.0]
    srv = DashboardServer(src, "127.0.0.1:0", sample_interval=0, clock=lambda: clock[0])
    port = await srv.start()
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/") as r:
                assert r.status == 200 and r.content_type == "text/html"
                body = await r.text()
                assert "/static/app.js" in body and "/static/style.css" in body
            for name, ctype in (("app.js", "application/javascript"), ("style.css", "text/css")):
                async with http.get(f"{base}/static/{name}") as r:
                    assert r.status == 200 and r.content_type == ctype and len(await r.read()) > 100
            for bad in ("/static/nope.js", "/static/..%2Fserver.py", "/api/other"):
                async with http.get(base + bad) as r:
                    assert r.status == 404, bad
            async with http.get(base + "/api/fleet") as r:
                assert r.status == 200 and r.headers["Cache-Control"] == "no-store"
                assert await r.json() == {"component": "shard", "id": "s1", "calls": 1, "now": 42.0}
            clock[0] = 42.5  # within reuse_seconds: the same snapshot, no second pass
            async with http.get(base + "/api/fleet") as r:
                assert (await r.json())["calls"] == 1 and src.calls == 1
            clock[0] = 43.5
            async with http.get(base + "/api/fleet") as r:
                assert (await r.json())["calls"] == 2
            async with http.post(base + "/api/fleet") as r:
                assert r.status == 405  # read-only
            src.fail = True
            clock[0] = 50.0
            async with http.get(base + "/api/fleet") as r:
                assert r.status == 500 and "boom" in (await r.json())["error"]
            async with http.get(base + "/healthz") as r:
                assert r.status == 200
    finally:
        await srv.stop()


async def test_sampler_keeps_refreshing_and_survives_errors() -> None:
    src = ScriptedSource()
    src.fail = True  # errors are logged, the loop goes on
    srv = DashboardServer(src, "127.0.0.1:0", sample_interval=0.01)
    await srv.start()
    try:
        async def enough() -> None:
            while src.calls < 5:
                await asyncio.sleep(0.01)
        await asyncio.wait_for(enough(), 30)
    finally:
        await srv.stop()


def test_listen_address_validation() -> None:
    assert split_hostport("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert split_hostport(":9") == ("0.0.0.0", 9)
    assert split_hostport("[::1]:9") == ("::1", 9)
    for bad in ("8080", "host:", "host:x"):
        with pytest.raises(ValueError):
            split_hostport(bad)


def test_sampler_backs_off_when_snapshots_are_expensive() -> None:
    srv = DashboardServer(ScriptedSource(), "127.0.0.1:0", sample_interval=2.0)
    assert srv.next_sample_delay() == 2.0
    srv.last_cost = 0.5  # a 50k-machine shard on a slow box
    assert srv.next_sample_delay() == 10.0
