"""The shard process's runtime care: collector pauses and event-loop lag.

The shard holds ~10^6 long-lived objects (records, protos, needs); a full collection walks them
all, ~0.1 s per 100 000 machines, on whichever thread triggers it -- usually the session loop.
What survived is therefore frozen (``gc.freeze``, a list splice) after every cycle and every
``interval`` seconds, and handed back for one full collection every ``unfreeze_every`` seconds.
Frozen objects are still freed by reference counting; cycles among them wait for that unfreeze.

The one-second settle matters because the collector counts allocations *minus deallocations*:
each new roll-up's needs replace old, frozen ones, so at 500 roll-ups/s the count barely moves
while the young list grows by ~25 000 survivors a second; left alone, a young collection came
every 3-6 s over ~100 000 objects, a 40-60 ms pause for every session.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from typing import Any

from bigfleet.observability import get_logger
from bigfleet.shard.metrics import ShardMetrics

log = get_logger("bigfleet.shard.runtime")


#: gc.set_threshold for the shard process and its engine worker: with survivors frozen (below), young
#: collections stay small and a full one comes only every 1 000 middle ones
GC_THRESHOLDS = (20_000, 20, 1_000)
#: how often frozen objects are handed back to the collector (bounds what a freeze can leak)
UNFREEZE_EVERY = 600.0


def settle_heap(now: float, last_unfreeze: float) -> float:
    """Freeze what survived, after one full collection if `UNFREEZE_EVERY` passed since
    ``last_unfreeze``; returns when the last full collection ran."""
    if now - last_unfreeze >= UNFREEZE_EVERY:
        last_unfreeze = now
        gc.unfreeze()
        gc.collect()
    gc.freeze()
    return last_unfreeze


class HeapSettler:
    def __init__(self, metrics: ShardMetrics, clock: Callable[[], float], interval: float = 1.0) -> None:
        self.metrics = metrics
        self.clock = clock
        self.interval = interval
        self.last_unfreeze = clock()
        self._gc_started = 0.0

    def settle(self) -> None:
        """Move what survived out of the collector's sight; a full collection now and then."""
        self.last_unfreeze = settle_heap(self.clock(), self.last_unfreeze)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.settle()

    def watch(self) -> None:
        if self._gc_watch not in gc.callbacks:
            gc.callbacks.append(self._gc_watch)

    def close(self) -> None:
        if self._gc_watch in gc.callbacks:
            gc.callbacks.remove(self._gc_watch)
        gc.unfreeze()  # what this term froze is collectable again (a later term starts afresh)

    def _gc_watch(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        took = time.perf_counter() - self._gc_started
        gen = info.get("generation", 0)
        self.metrics.gc_pause.labels(str(gen)).observe(took)
        if took > 0.05:
            log.info("long garbage collection", generation=gen, seconds=round(took, 3),
                     collected=info.get("collected", 0))


async def watch_loop_lag(metrics: ShardMetrics, period: float = 0.1) -> None:
    """Sessions are served by this loop; a stall here is latency for every operator."""
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(period)
        metrics.loop_lag.observe(max(0.0, time.perf_counter() - t0 - period))
