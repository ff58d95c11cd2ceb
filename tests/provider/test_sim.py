"""The in-process simulated provider on a virtual clock."""

from __future__ import annotations

import grpc
import pytest

from bigfleet.provider.fake.backend import Dwell, FaultPlan, FaultRule
from bigfleet.provider.fake.catalog import build_catalog
from bigfleet.provider.fake.sim import SimProvider, SimStub
from bigfleet.provider.kit.model import Kind
from bigfleet.provider.kit.server import KitOptions
from bigfleet.v1alpha1 import provider_pb2 as pb


def test_dwell_on_virtual_clock() -> None:
    sim = SimProvider(build_catalog(4), Dwell(create=30, configure=5), now=100.0)
    ack = sim.create(pb.CreateRequest(machine_id="aws-00000"))
    assert ack.machine.state == pb.MACHINE_STATE_CREATING
    assert sim.next_due() == 130.0
    assert sim.advance(129.9) == []
    done = sim.advance(130.0)
    assert [(c.machine_id, c.kind, c.applied) for c in done] == [("aws-00000", Kind.CREATE, True)]
    m = sim.get(pb.MachineRef(id="aws-00000"))
    assert m.state == pb.MACHINE_STATE_IDLE and m.host.ref
    sim.configure(pb.ConfigureRequest(machine_id="aws-00000", cluster_id="c"))
    sim.advance(200)
    assert sim.get(pb.MachineRef(id="aws-00000")).state == pb.MACHINE_STATE_CONFIGURED
    with pytest.raises(ValueError):
        sim.advance(10)


def test_faults_and_timeouts_are_deterministic() -> None:
    plan = FaultPlan([FaultRule("hang", cluster="bad")], fail_rate=0.5, rate_kinds=frozenset({Kind.CREATE}), seed=7)
    opts = KitOptions(configure_timeout=60)
    sim = SimProvider(build_catalog(20), Dwell(create=1), plan, opts)
    for i in range(20):
        sim.create(pb.CreateRequest(machine_id=_id(sim, i)))
    sim.advance(1)
    states = [m.state for m in sim.list(pb.ListFilter()).machines]
    failed = states.count(pb.MACHINE_STATE_FAILED)
    assert 3 <= failed <= 17 and states.count(pb.MACHINE_STATE_IDLE) == 20 - failed
    idle = next(m.id for m in sim.list(pb.ListFilter(states=[pb.MACHINE_STATE_IDLE])).machines)
    sim.configure(pb.ConfigureRequest(machine_id=idle, cluster_id="bad"))
    assert sim.next_due() == 61
    sim.advance(61)
    m = sim.get(pb.MachineRef(id=idle))
    assert m.state == pb.MACHINE_STATE_FAILED and "timed out" in m.last_error
    # same seed, same outcome
    sim2 = SimProvider(build_catalog(20), Dwell(create=1),
                       FaultPlan([], fail_rate=0.5, rate_kinds=frozenset({Kind.CREATE}), seed=7), opts)
    for i in range(20):
        sim2.create(pb.CreateRequest(machine_id=_id(sim2, i)))
    sim2.advance(1)
    assert sorted(m.state for m in sim2.list(pb.ListFilter()).machines) == sorted(states)


def _id(sim: SimProvider, i: int) -> str:
    return sorted(sim.core.machines)[i]


async def test_stub_raises_wire_errors() -> None:
    stub = SimStub(SimProvider(build_catalog(2)))
    lst = await stub.List(pb.ListFilter())
    assert len(lst.machines) == 2 and lst.revision == b"2"
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.Get(pb.MachineRef(id="nope"))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    await stub.Create(pb.CreateRequest(machine_id="aws-00000", shard_id="s", shard_epoch=1, sequence_number=2))
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await stub.Create(pb.CreateRequest(machine_id="aws-00000", shard_id="s", shard_epoch=1, sequence_number=2))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
