"""Reconcile: merge the provider's records into the shard's view of its machines.

Incremental ``List`` calls (``since_revision``) every ``interval``, on their own task so a cycle
never waits on a provider ``List`` (a full one at 500k machines takes seconds to serve); a full
``List``, which also forgets machines the provider erased, every ``full_every``-th call and
whenever the provider returns no cursor. Only machines the ownership rule gives this shard are
kept: a record that is another shard's is dropped at once, never skipped, because deciding on a
stale copy of it (a Speculative slot that is Configured elsewhere by now) would act on it.

With several providers (bigfleet.shard.providers) each is a source with its own cursor and scope:
its full List forgets only its own machines, and one that fails leaves its machines as last read
while the others are merged.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from bigfleet.observability import get_logger
from bigfleet.shard.executor import Executor
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.provider_client import ProviderError
from bigfleet.shard.providers import ListSource, ShardProvider
from bigfleet.shard.view import MachineView
from bigfleet.v1alpha1 import provider_pb2

log = get_logger("bigfleet.shard.reconcile")


class Reconciler:
    def __init__(self, view: MachineView, provider: ShardProvider, executor: Executor,
                 owns: Callable[[provider_pb2.Machine], bool], drop: Callable[[str], None], metrics: ShardMetrics,
                 clock: Callable[[], float], interval: float = 1.0, full_every: int = 300,
                 initial_grace: float = 15.0) -> None:
        self.view = view
        self.provider = provider
        self.executor = executor
        self.owns = owns
        self.drop = drop
        self.metrics = metrics
        self.clock = clock
        self.interval = interval
        self.full_every = full_every
        # With several providers: how long the first reconcile waits for all of them before the
        # shard decides on the ones that answered (one provider down must not stall the others).
        self.initial_grace = initial_grace
        self.done_once = asyncio.Event()  # set after the first successful full List
        self.last_at = 0.0
        self.count = 0
        self._sources = list(provider.sources())
        # Per source (provider): its List cursor, its calls so far, whether it was ever read in full.
        self._cursor: dict[str, bytes] = {s.name: b"" for s in self._sources}
        self._count: dict[str, int] = {s.name: 0 for s in self._sources}
        self.read_once: set[str] = set()

    async def reconcile(self, full: bool = False) -> None:
        """Merge every provider's records; a provider that fails is skipped (its machines stay as last
        read) and its error raised after the others are merged."""
        started = time.perf_counter()
        self.view.end_cooldowns(self.executor.clock())
        if len(self._sources) == 1:
            await self._reconcile_source(self._sources[0], full)
        else:
            results = await asyncio.gather(*(self._reconcile_source(s, full) for s in self._sources),
                                           return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                self._finish(started)
                raise errors[0]
        self._finish(started)
        if not self.done_once.is_set() and len(self.read_once) == len(self._sources):
            self.done_once.set()
            log.info("first reconcile done", machines=len(self.view))

    def _finish(self, started: float) -> None:
        self.count += 1
        self.last_at = self.clock()
        self.metrics.phase_duration.labels("reconcile").observe(time.perf_counter() - started)

    async def _reconcile_source(self, src: ListSource, full: bool) -> None:
        """One provider's List merged; a full one forgets only machines under that provider's prefix."""
        name, prefix = src.name, src.prefix
        cursor = self._cursor[name]
        full = full or not cursor or self._count[name] % self.full_every == 0
        mark = self.executor.end_mark()
        reachable = self.metrics.provider_reachable.labels(name or "default")
        try:
            lst = await src.list(b"" if full else cursor)
        except ProviderError:
            reachable.set(0)
            raise
        reachable.set(1)
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
                if prefix and not mid.startswith(prefix):
                    continue  # another provider's machine: only its own List may forget it
                if mid not in seen and mid not in view.inflight and mid not in view.failed_local:
                    view.forget(mid)
            if name not in self.read_once:
                self.read_once.add(name)
                if len(self._sources) > 1:
                    log.info("provider read", provider=name, machines=len(lst.machines))
        self._cursor[name] = bytes(lst.revision)
        self._count[name] += 1

    async def initial(self, stopping: asyncio.Event) -> None:
        """Full List, retried until it works: no decision is made on an inventory we have not read.

        With several providers, every one is waited for up to ``initial_grace`` seconds; after that
        the shard starts on those that answered and ``run`` keeps reading the others in full."""
        delay = 0.2
        started = self.clock()
        while not stopping.is_set():
            pending = [s for s in self._sources if s.name not in self.read_once]
            results = await asyncio.gather(*(self._reconcile_source(s, True) for s in pending),
                                           return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            for e in errors:
                if not isinstance(e, ProviderError):
                    raise e
            missing = [s.name for s in self._sources if s.name not in self.read_once]
            if not missing or (self.read_once and self.clock() - started >= self.initial_grace):
                if missing:
                    log.warning("starting without some providers; their machines join when they answer",
                                missing=missing, waited_seconds=round(self.clock() - started, 1))
                self.count += 1
                self.last_at = self.clock()
                self.done_once.set()
                log.info("first reconcile done", machines=len(self.view))
                return
            log.warning("initial reconcile failed; retrying", error=str(errors[0]) if errors else "",
                        missing=missing, retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def run(self, stopping: asyncio.Event) -> None:
        """Merge the provider's changes every ``interval``, independent of cycles; with several
        providers, each on its own loop, so a slow or unreachable one never holds the others back."""
        if len(self._sources) == 1:
            await self._run(stopping, self.reconcile)
            return
        await asyncio.gather(*(self._run(stopping, self._source_step(s)) for s in self._sources))

    def _source_step(self, src: ListSource) -> Callable[[], Awaitable[None]]:
        async def step() -> None:
            started = time.perf_counter()
            try:
                await self._reconcile_source(src, False)
            except ProviderError as exc:
                raise ProviderError(exc.rpc, exc.code, f"provider {src.name!r}: {exc.details}") from None
            self._finish(started)
            if not self.done_once.is_set() and len(self.read_once) == len(self._sources):
                self.done_once.set()
        return step

    async def _run(self, stopping: asyncio.Event, step: Callable[[], Awaitable[None]]) -> None:
        interval = max(self.interval, 0.05)
        while not stopping.is_set():
            try:
                await asyncio.wait_for(stopping.wait(), interval)
                return
            except TimeoutError:
                pass
            try:
                await step()
            except ProviderError as exc:
                log.warning("reconcile failed; cycles decide on the last known inventory", error=str(exc))
            except Exception:
                log.exception("reconcile failed")
