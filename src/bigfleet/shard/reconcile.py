"""Reconcile: merge the provider's records into the shard's view of its machines.

Incremental ``List`` calls (``since_revision``) every ``interval``, on their own task so a cycle
never waits on a provider ``List`` (a full one at 500k machines takes seconds to serve); a full
``List``, which also forgets machines the provider erased, every ``full_every``-th call and
whenever the provider returns no cursor. Only machines the ownership rule gives this shard are
kept: a record that is another shard's is dropped at once, never skipped, because deciding on a
stale copy of it (a Speculative slot that is Configured elsewhere by now) would act on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from bigfleet.observability import get_logger
from bigfleet.shard.executor import Executor
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.provider_client import ProviderClient, ProviderError
from bigfleet.shard.view import MachineView
from bigfleet.v1alpha1 import provider_pb2

log = get_logger("bigfleet.shard.reconcile")


class Reconciler:
    def __init__(self, view: MachineView, provider: ProviderClient, executor: Executor,
                 owns: Callable[[provider_pb2.Machine], bool], drop: Callable[[str], None], metrics: ShardMetrics,
                 clock: Callable[[], float], interval: float = 1.0, full_every: int = 300) -> None:
        self.view = view
        self.provider = provider
        self.executor = executor
        self.owns = owns
        self.drop = drop
        self.metrics = metrics
        self.clock = clock
        self.interval = interval
        self.full_every = full_every
        self.done_once = asyncio.Event()  # set after the first successful full List
        self.last_at = 0.0
        self.count = 0
        self._cursor = b""

    async def reconcile(self, full: bool = False) -> None:
        """Merge the provider's records; a full List also forgets machines the provider erased."""
        full = full or not self._cursor or self.count % self.full_every == 0
        started = time.perf_counter()
        mark = self.executor.end_mark()
        lst = await self.provider.list(b"" if full else self._cursor)
        view, seen = self.view, set[str]()
        for i, pb in enumerate(lst.machines):
            if i % 1000 == 999:
                await asyncio.sleep(0)  # a big List must not hold the loop (sessions wait)
            if not self.owns(pb):
                if pb.id not in view.inflight and view.get(pb.id) is not None:
                    self.drop(pb.id)
                continue
            seen.add(pb.id)
            if self.executor.ended_after(pb.id, mark):
                self.executor.recheck(pb)  # this record may predate the flow that just ended
                continue
            view.observe(pb)
        if full:
            for i, mid in enumerate(view.ids()):
                if i % 5000 == 4999:
                    await asyncio.sleep(0)
                if mid not in seen and mid not in view.inflight and mid not in view.failed_local:
                    view.forget(mid)
        self._cursor = bytes(lst.revision)
        self.count += 1
        self.last_at = self.clock()
        self.metrics.phase_duration.labels("reconcile").observe(time.perf_counter() - started)
        if not self.done_once.is_set():
            self.done_once.set()
            log.info("first reconcile done", machines=len(view))

    async def initial(self, stopping: asyncio.Event) -> None:
        """Full List, retried until it works: no decision is made on an inventory we have not read."""
        delay = 0.2
        while not stopping.is_set():
            try:
                await self.reconcile(full=True)
                return
            except ProviderError as exc:
                log.warning("initial reconcile failed; retrying", error=str(exc), retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def run(self, stopping: asyncio.Event) -> None:
        """Merge the provider's changes every ``interval``, independent of cycles."""
        interval = max(self.interval, 0.05)
        while not stopping.is_set():
            try:
                await asyncio.wait_for(stopping.wait(), interval)
                return
            except TimeoutError:
                pass
            try:
                await self.reconcile()
            except ProviderError as exc:
                log.warning("reconcile failed; cycles decide on the last known inventory", error=str(exc))
            except Exception:
                log.exception("reconcile failed")
