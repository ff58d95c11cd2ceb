"""Retiring a machine that will never serve: its Node did not register within the operator's timeout.

The machine is failed here first (it stops counting as supply at once, the engine provisions a
replacement, and the operator sees FAILED with the reason). It is still Configured at the provider,
costing money, so this flow then hands it back: the cluster's operator is told (the reclaim rule
holds here too; nothing runs on a Node that never registered, so it acks at once), the provider
drains it and deletes it (its slot returns to Speculative). The record stays FAILED on this leader;
a later leader reads the slot afresh from the provider.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from bigfleet.observability import get_logger
from bigfleet.shard.executor import Executor
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.provider_client import ProviderError
from bigfleet.shard.providers import ShardProvider
from bigfleet.v1alpha1 import provider_pb2

log = get_logger("bigfleet.shard.retire")
S = provider_pb2.MachineState


class Retirer:
    def __init__(self, provider: ShardProvider, executor: Executor, metrics: ShardMetrics,
                 clock: Callable[[], float], timeout: float = 120.0, poll: float = 0.5) -> None:
        self.provider = provider
        self.executor = executor
        self.metrics = metrics
        self.clock = clock
        self.timeout = timeout
        self.poll = poll
        self._tasks: set[asyncio.Task[None]] = set()

    def retire(self, machine_id: str, cluster: str, node: str) -> None:
        task = asyncio.get_running_loop().create_task(self._flow(machine_id, cluster, node),
                                                      name=f"retire-{machine_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _flow(self, machine_id: str, cluster: str, node: str) -> None:
        outcome = await self._hand_back(machine_id, cluster, node)
        self.metrics.retirements.labels(outcome).inc()
        log.info("machine retired" if outcome == "deleted" else "machine not retired", machine=machine_id,
                 cluster=cluster, outcome=outcome)

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
