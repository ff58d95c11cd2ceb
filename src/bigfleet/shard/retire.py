"""Retiring a machine that will never serve: its Node did not register within the operator's timeout.

The machine is failed here first (it stops counting as supply at once, the engine provisions a
replacement, and the operator sees FAILED with the reason). It is still Configured at the provider,
costing money, so this flow then hands it back: the cluster's operator is told (the reclaim rule
holds here too; nothing runs on a Node that never registered, so it acks at once), the provider
drains it and deletes it (its slot returns to Speculative).

A hand-back is recorded in the replicated state (``HAState.retiring``) before it starts and cleared
when it is done: a new leader (``resume``) fails the machine again and finishes the hand-back, where
the provider's word alone (still Configured) would have made it healthy supply again. A failed
attempt (no session, the provider refusing) is retried with backoff; after the last attempt the
entry stays, with its reason, for the next leader.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from bigfleet.machine import MachineState
from bigfleet.observability import get_logger
from bigfleet.shard.executor import Executor
from bigfleet.shard.ha.node import RaftError, ShardLog
from bigfleet.shard.ha.state import Retiring
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.provider_client import ProviderError
from bigfleet.shard.providers import ShardProvider
from bigfleet.shard.view import MachineView
from bigfleet.v1alpha1 import provider_pb2

log = get_logger("bigfleet.shard.retire")
S = provider_pb2.MachineState


class Retirer:
    def __init__(self, provider: ShardProvider, executor: Executor, view: MachineView, log: ShardLog, epoch: int,
                 metrics: ShardMetrics, clock: Callable[[], float], wall_ns: Callable[[], int],
                 timeout: float = 120.0, poll: float = 0.5, retry: float = 15.0, attempts: int = 6) -> None:
        self.provider = provider
        self.executor = executor
        self.view = view
        self.log = log
        self.epoch = epoch
        self.metrics = metrics
        self.clock = clock
        self.wall_ns = wall_ns
        self.timeout = timeout
        self.poll = poll
        self.retry = retry
        self.attempts = attempts
        self._tasks: set[asyncio.Task[None]] = set()

    def retire(self, machine_id: str, cluster: str, node: str, reason: str) -> None:
        """Hand back a machine this leader just failed (``reason`` is its last_error)."""
        self._spawn(machine_id, self._flow(machine_id, Retiring(cluster, node, reason, self.wall_ns()), True))

    def resume(self) -> int:
        """After the first reconcile of a term: finish the hand-backs an earlier leader started.
        Returns how many were resumed."""
        entries = self.log.read(lambda s: dict(s.retiring))
        resumed = 0
        for mid, entry in entries.items():
            m = self.view.machine(mid)
            if m is not None and m.state is MachineState.CONFIGURED and m.cluster == entry.cluster:
                self.view.mark_failed(mid, entry.reason)
                self._spawn(mid, self._flow(mid, entry, False))
                resumed += 1
            else:  # drained, deleted, rebound or gone meanwhile: nothing left to hand back
                self._spawn(mid, self._track(mid, None))
        if resumed:
            log.info("resumed machine hand-backs from an earlier leader", machines=resumed)
        return resumed

    def _spawn(self, machine_id: str, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=f"retire-{machine_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flow(self, machine_id: str, entry: Retiring, record: bool) -> None:
        if record:
            await self._track(machine_id, entry)
        delay = self.retry
        for attempt in range(1, self.attempts + 1):
            outcome = await self._hand_back(machine_id, entry.cluster, entry.node)
            self.metrics.retirements.labels(outcome).inc()
            if outcome == "deleted":
                log.info("machine retired", machine=machine_id, cluster=entry.cluster)
                await self._track(machine_id, None)
                return
            log.warning("machine not retired yet", machine=machine_id, cluster=entry.cluster, outcome=outcome,
                        attempt=attempt, reason=entry.reason)
            if attempt < self.attempts:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 300.0)
        log.error("giving up handing back a machine this term; the next leader tries again", machine=machine_id,
                  cluster=entry.cluster, reason=entry.reason)

    async def _track(self, machine_id: str, entry: Retiring | None) -> None:
        try:
            await self.log.track_retiring(machine_id, entry, self.epoch)
        except RaftError as exc:  # (not fatal: the operator's repeated report fails it again)
            log.warning("could not record a machine hand-back", machine=machine_id, error=str(exc))

    async def _hand_back(self, machine_id: str, cluster: str, node: str) -> str:
        refused = await self.executor.tell_operator(machine_id, cluster, node, 0, 0)
        if refused:
            return refused
        try:
            await self.provider.drain(machine_id, 0)
            if not await self._until(machine_id, S.MACHINE_STATE_IDLE):
                return "drain_timeout"
            await self.provider.delete(machine_id)
            if not await self._until(machine_id, S.MACHINE_STATE_SPECULATIVE):
                return "delete_timeout"
        except ProviderError as exc:
            log.warning("retiring a machine failed at the provider", machine=machine_id, error=str(exc))
            return "provider_error"
        return "deleted"

    async def _until(self, machine_id: str, state: int) -> bool:
        deadline = self.clock() + self.timeout
        while self.clock() < deadline:
            pb = await self.provider.get(machine_id)
            if pb.state == state:
                return True
            if pb.state == S.MACHINE_STATE_FAILED:
                return False
            await asyncio.sleep(self.poll)
        return False

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
