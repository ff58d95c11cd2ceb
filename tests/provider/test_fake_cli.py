"""`bigfleet fake-provider` as a real subprocess: health, lifecycle over gRPC, durable state file."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from bigfleet.testing import wait_until
from bigfleet.v1alpha1 import provider_pb2 as pb
from bigfleet.v1alpha1 import provider_pb2_grpc as pbg

from .conftest import start_fake

pytestmark = pytest.mark.slow


def stub(target: str) -> tuple[grpc.Channel, pbg.CapacityProviderStub]:
    ch = grpc.insecure_channel(target)
    return ch, pbg.CapacityProviderStub(ch)


def state_of(s: pbg.CapacityProviderStub, mid: str) -> int:
    return int(s.Get(pb.MachineRef(id=mid), timeout=10).state)


def test_fake_provider_lifecycle_and_catalog(fake_provider: str) -> None:
    ch, s = stub(fake_provider)
    with ch:
        full = s.List(pb.ListFilter(), timeout=10)
        assert len(full.machines) == 36 and full.revision == b"36"
        types = {m.capacity_type for m in full.machines}
        assert {pb.CAPACITY_TYPE_BARE_METAL, pb.CAPACITY_TYPE_RESERVED, pb.CAPACITY_TYPE_ON_DEMAND,
                pb.CAPACITY_TYPE_SPOT} <= types
        assert all(m.zone and m.instance_type for m in full.machines)
        assert all(m.interruption_probability > 0 for m in full.machines if m.capacity_type == pb.CAPACITY_TYPE_SPOT)
        mid = s.List(pb.ListFilter(states=[pb.MACHINE_STATE_SPECULATIVE], max_results=1), timeout=10).machines[0].id
        ack = s.Create(pb.CreateRequest(machine_id=mid, shard_id="s", shard_epoch=1, sequence_number=1), timeout=10)
        assert ack.operation_id and ack.machine.state in (pb.MACHINE_STATE_CREATING, pb.MACHINE_STATE_IDLE)
        wait_until(lambda: state_of(s, mid) == pb.MACHINE_STATE_IDLE, 30, what="IDLE")
        s.Configure(pb.ConfigureRequest(machine_id=mid, cluster_id="c1", shard_id="s", shard_epoch=1,
                                        sequence_number=2, shard_metadata={"k": "v"}), timeout=10)
        wait_until(lambda: state_of(s, mid) == pb.MACHINE_STATE_CONFIGURED, 30, what="CONFIGURED")
        m = s.Get(pb.MachineRef(id=mid), timeout=10)
        assert m.cluster == "c1" and dict(m.shard_metadata) == {"k": "v"} and m.host.ref
        with pytest.raises(grpc.RpcError) as ei:
            s.Drain(pb.DrainRequest(machine_id=mid, shard_id="s", shard_epoch=1, sequence_number=2), timeout=10)
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_state_file_survives_kill(tmp_path: Path) -> None:
    state = tmp_path / "state" / "provider.json"
    proc, target = start_fake(tmp_path, "--seed-count", "8", "--state-file", str(state), "--configure-delay", "60")
    try:
        ch, s = stub(target)
        with ch:
            ids = sorted(m.id for m in s.List(pb.ListFilter(), timeout=10).machines)
            a, b = ids[0], ids[1]
            s.Create(pb.CreateRequest(machine_id=a, shard_id="s", shard_epoch=3, sequence_number=7), timeout=10)
            s.Create(pb.CreateRequest(machine_id=b), timeout=10)
            wait_until(lambda: state_of(s, b) == pb.MACHINE_STATE_IDLE, 30, what="IDLE")
            ack = s.Configure(pb.ConfigureRequest(machine_id=b, cluster_id="c"), timeout=10)
            assert ack.machine.state == pb.MACHINE_STATE_CONFIGURING  # dwell of 60 s: still in flight at kill
            rev = s.List(pb.ListFilter(), timeout=10).revision
        proc.kill()
        proc2, target2 = start_fake(tmp_path, "--seed-count", "999", "--state-file", str(state), name="restarted")
        try:
            ch, s = stub(target2)
            with ch:
                after = s.List(pb.ListFilter(), timeout=10)
                assert sorted(m.id for m in after.machines) == ids  # no re-seeding
                assert int(after.revision) > int(rev)
                mb = s.Get(pb.MachineRef(id=b), timeout=10)
                assert mb.state == pb.MACHINE_STATE_FAILED and "interrupted" in mb.last_error and mb.cluster == "c"
                with pytest.raises(grpc.RpcError) as ei:
                    s.Create(pb.CreateRequest(machine_id=a, shard_id="s", shard_epoch=3, sequence_number=7), timeout=10)
                assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                ack = s.Create(pb.CreateRequest(machine_id=ids[2]), timeout=10)
                assert ack.operation_id not in ("op-1", "op-2", "op-3")
            assert proc2.stop() == 0, proc2.logs()  # SIGTERM: a clean exit
        finally:
            proc2.stop()
    finally:
        proc.stop()
