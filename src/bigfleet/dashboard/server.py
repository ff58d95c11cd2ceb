"""The dashboard's HTTP side (aiohttp): the static page and its JSON, read-only.

A background sampler refreshes the source every few seconds so the charts have points even when
nobody has the page open; requests read a fresh snapshot (cheap: counts over the in-memory view).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from aiohttp import web

from bigfleet.dashboard.sources import Source
from bigfleet.observability import get_logger

log = get_logger("bigfleet.dashboard")

# The only files served; nothing is looked up from the request path.
ASSETS = {
    "index.html": "text/html",
    "app.js": "application/javascript",
    "style.css": "text/css",
}


def asset(name: str) -> bytes:
    return resources.files("bigfleet.dashboard").joinpath("static", name).read_bytes()


def split_hostport(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {listen!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


class DashboardServer:
    def __init__(self, source: Source, listen: str, sample_interval: float = 2.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.source = source
        self.listen = listen
        self.sample_interval = sample_interval
        self.clock = clock
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._assets = {name: asset(name) for name in ASSETS}
        self.reuse_seconds = 1.0
        self.last_cost = 0.0
        self._cached: tuple[float, dict[str, Any]] | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._static)
        app.router.add_get("/api/fleet", self._fleet)
        app.router.add_get("/healthz", self._healthz)
        return app

    async def start(self) -> int:
        host, port = split_hostport(self.listen)
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port
        if self.sample_interval > 0:
            self._sampler = asyncio.create_task(self._sample_loop(), name="dashboard-sampler")
        log.info("dashboard serving", listen=self.listen, port=self.port, component=self.source.component)
        return self.port

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        if self._runner is not None:
            await self._runner.cleanup()

    async def snapshot(self) -> dict[str, Any]:
        """A fresh snapshot, or one taken less than ``reuse_seconds`` ago: many open pages (or a
        reload storm) cost one pass over the inventory, not one each."""
        async with self._lock:  # one snapshot at a time: the history ring is not re-entrant
            now = self.clock()
            if self._cached is not None and 0 <= now - self._cached[0] < self.reuse_seconds:
                return self._cached[1]
            t0 = time.perf_counter()
            data = await self.source.snapshot(now)
            self.last_cost = time.perf_counter() - t0
            self._cached = (now, data)
            return data

    def next_sample_delay(self) -> float:
        """Keep the sampler's share of the event loop under ~5% on big shards."""
        return max(self.sample_interval, 20 * self.last_cost)

    async def _sample_loop(self) -> None:
        while True:
            try:
                await self.snapshot()
            except Exception as exc:
                log.warning("dashboard sample failed", error=str(exc))
            await asyncio.sleep(self.next_sample_delay())

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(body=self._assets["index.html"], content_type="text/html", charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in ASSETS:
            raise web.HTTPNotFound(text="no such asset")
        return web.Response(body=self._assets[name], content_type=ASSETS[name], charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def _fleet(self, request: web.Request) -> web.Response:
        try:
            data = await self.snapshot()
        except Exception as exc:
            log.warning("dashboard snapshot failed", error=str(exc))
            return web.json_response({"error": f"snapshot failed: {exc}"}, status=500)
        return web.Response(text=json.dumps(data, sort_keys=True), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")
