"""The leadership controller in-process: a real one-replica Raft group and a real fake-provider
process; fencing by the provider makes the leader step down and stay down for that term."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2

from bigfleet.observability import new_registry
from bigfleet.rpc import insecure_channel
from bigfleet.shard.daemon import DaemonConfig
from bigfleet.shard.ha.controller import HAController
from bigfleet.shard.ha.node import ShardRaft, ShardRaftConfig
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.provider_client import ProviderClient, ProviderError
from bigfleet.testing import ManagedProcess, free_port, wait_for_health
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2, provider_pb2_grpc

from .group import PASSWORD, need, until

pytestmark = pytest.mark.slow


async def _status(health: grpc_health.aio.HealthServicer) -> int:
    # (the servicer's own Check, without a network hop)
    class Ctx:
        async def abort(self, code: object, details: str) -> None:
            raise AssertionError(details)

    r = await health.Check(health_pb2.HealthCheckRequest(service=""), Ctx())
    return int(r.status)


async def test_fenced_leader_steps_down_and_stays_down_for_the_term() -> None:
    paddr = f"127.0.0.1:{free_port()}"
    prov = ManagedProcess.bigfleet(["fake-provider", "--listen", paddr, "--seed-count", "4",
                                    "--log-format", "console"], "provider").start()
    raft = ShardRaft(ShardRaftConfig(f"127.0.0.1:{free_port()}", [], Path(tempfile.mkdtemp()), PASSWORD))
    health = grpc_health.aio.HealthServicer()
    cfg = DaemonConfig(shard_id="s1", provider=paddr, epoch=0, cycle_interval=0.3, min_cycle_gap=0.05,
                       reconcile_interval=0.2)
    ctrl = HAController(raft, cfg, ShardMetrics(new_registry()), health, advertise="127.0.0.1:1",
                        registry=new_registry())
    rival = ProviderClient(paddr, "s1", 1000, max_attempts=1)
    task = asyncio.create_task(ctrl.run())
    try:
        wait_for_health(paddr, timeout=60)
        await until(lambda: _leading(ctrl), 30, "leadership")
        assert ctrl.epoch == 1 and await _status(health) == health_pb2.HealthCheckResponse.SERVING
        d = ctrl.daemon
        assert d is not None
        # Roll-ups are committed through Raft before they are applied.
        outcome = await d.handle_rollup("c1", capacity_pb2.ClusterCapacityNeeds(cluster_id="c1", needs=[need("1")]))
        assert outcome.accepted
        assert raft.read(lambda s: set(s.rollups)) == {"c1"}
        # A newer incarnation acts on a machine; our next call on it is refused and we step down.
        async with insecure_channel(paddr) as ch:
            lst = await provider_pb2_grpc.CapacityProviderStub(ch).List(provider_pb2.ListFilter(), timeout=10)
        spec = next(m.id for m in lst.machines if m.state == provider_pb2.MACHINE_STATE_SPECULATIVE)
        await rival.create(spec)
        with pytest.raises(ProviderError) as err:
            await d.provider.delete(spec)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        await until(lambda: _stepped_down(ctrl), 30, "step-down")
        assert await _status(health) == health_pb2.HealthCheckResponse.NOT_SERVING
        # Still Raft leader in the same term, but it does not lead the shard again in that term.
        polls = ctrl.polls
        await until(lambda: _polled(ctrl, polls + 20), 30, "20 more leadership polls")
        assert raft.is_leader() and ctrl.daemon is None and ctrl.takeovers == 1
        # A roll-up reaching a stepped-down daemon is refused, not acknowledged.
        late = await d.handle_rollup("c2", capacity_pb2.ClusterCapacityNeeds(cluster_id="c2", needs=[need("2")]))
        assert not late.accepted
    finally:
        await ctrl.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await rival.close()
        raft.destroy()
        prov.stop()


async def _leading(ctrl: HAController) -> bool:
    return ctrl.daemon is not None


async def _stepped_down(ctrl: HAController) -> bool:
    return ctrl.daemon is None and ctrl.takeovers == 1


async def _polled(ctrl: HAController, n: int) -> bool:
    return ctrl.polls >= n
