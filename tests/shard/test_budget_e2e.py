"""Disruption budgets and the empty-roll-up guard as real processes: a real shard (a Raft group of
one), a real fake provider behind a recording spy, and an operator stand-in.

* A cluster whose demand collapses is reclaimed at the budget's rate over ~25 s of cycles
  (cycles run every 0.3 s; the budget allows 2 per 8 s): never faster, and not stalled either.
* A small cluster (one need for three machines) that drops to nothing is held, not reclaimed,
  until the collapse was restated three times over at least 30 s.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from bigfleet.shard.sessions import HELD_ECHO
from bigfleet.v1alpha1 import provider_pb2, shard_pb2

from .cluster import ShardProc, start_provider
from .opsim import FakeOperator, need
from .spy import spy_provider, until

pytestmark = pytest.mark.slow
CONFIGURED = provider_pb2.MachineState.MACHINE_STATE_CONFIGURED


async def _bound(shard: ShardProc, cluster: str, n: int) -> bool:
    return (await shard.counts()).bound_by_cluster.get(cluster, 0) == n


async def test_collapsed_demand_is_reclaimed_at_the_budget_rate_not_the_cycle_rate() -> None:
    prov, paddr = start_provider("--seed-count", "0", "--committed-count", "12")
    try:
        async with spy_provider(paddr) as (spy, spy_addr):
            shard = await ShardProc(spy_addr, extra=("--disruption-budget", "2/4s;reasons=reclaim",
                                                      "--no-empty-rollup-guard")).start()
            reclaimed_at: list[float] = []

            def on_frame(msg: shard_pb2.ShardMessage) -> None:
                if msg.WhichOneof("payload") == "reclaim_instruction":
                    reclaimed_at.extend(time.monotonic() for _ in msg.reclaim_instruction.nodes)

            try:
                async with FakeOperator(shard.addr, "c1", on_frame=on_frame) as op:
                    await op.send_rollup([need("7", count=12)])
                    await until(lambda: _bound(shard, "c1", 12), 90, "12 machines configured for c1")
                    start = time.monotonic()
                    await op.send_rollup([])
                    await asyncio.sleep(14)
                    cycles = await shard.cycle()
                times = sorted(t - start for t in reclaimed_at)
                assert len(times) >= 6, times  # the budget paces reclaims, it does not stop them
                for i, t in enumerate(times):  # never more than 2 in any 4 s (0.5 s of slack for delivery)
                    assert sum(1 for u in times[i:] if u < t + 3.5) <= 2, times
                assert len(times) <= 8, times
                assert cycles > 30  # many cycles ran meanwhile: a per-cycle cap alone would have taken all 12
                drained = {r.machine_id for r in spy.of("Drain")}
                assert len(drained) <= len(times)  # every provider Drain followed its ReclaimInstruction
            finally:
                if shard.proc is not None:
                    shard.proc.stop()
    finally:
        prov.stop()


@pytest.mark.heavy  # (the hold's rules: tests/shard/test_units.py; the held ack on the wire: test_verdicts.py)
async def test_small_cluster_collapse_is_held_until_restated_for_30_seconds() -> None:
    prov, paddr = start_provider("--seed-count", "0", "--committed-count", "3")
    try:
        async with spy_provider(paddr) as (spy, spy_addr):
            shard = await ShardProc(spy_addr).start()
            try:
                async with FakeOperator(shard.addr, "small") as op:
                    await op.send_rollup([need("7", count=3)])
                    await until(lambda: _bound(shard, "small", 3), 90, "3 machines configured")
                    held_from = time.monotonic()
                    await op.send_rollup([])
                    await until(lambda: op.acks(HELD_ECHO), 10, "the held ack")
                    # restate the collapse every 2 s; nothing may be reclaimed for 30 s
                    while time.monotonic() - held_from < 28:
                        await asyncio.sleep(2)
                        await op.send_rollup([])
                        assert not op.reclaims() and not spy.of("Drain"), "reclaimed before the hold ended"
                    assert await _bound(shard, "small", 3)
                    for _ in range(4):  # past 30 s and three restatements: it applies
                        await asyncio.sleep(2)
                        await op.send_rollup([])
                    await until(lambda: op.reclaims(), 30, "the confirmed collapse reclaims")
            finally:
                if shard.proc is not None:
                    shard.proc.stop()
    finally:
        prov.stop()
