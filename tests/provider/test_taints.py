"""Provider-declared taints: the kit carries them on every record (proto, cached wire bytes, state file),
refuses malformed ones, the fake provider takes them from ``--node-taint``, and the shard forwards them
in ``NodeStateUpdate.taints``."""

from __future__ import annotations

import argparse

import pytest

from bigfleet.provider.fake.cli import _taint
from bigfleet.provider.kit.model import (
    CapacityType,
    InvalidRecord,
    MachineRecord,
    State,
    Taint,
    record_from_instance,
    validate_instance,
)
from bigfleet.provider.kit.model import Instance as Inst
from bigfleet.shard.view import node_state_update
from bigfleet.v1alpha1 import provider_pb2

GPU = Taint("nvidia.com/gpu", "NoSchedule", "present")
DEDICATED = Taint("dedicated", "PreferNoSchedule")


def _inst(*taints: Taint) -> Inst:
    return Inst(id="m1", instance_type="g5.xlarge", zone="z1", capacity_type=CapacityType.ON_DEMAND,
                price_per_hour=1.0, resources={"cpu": "4"}, taints=taints)


def test_record_carries_taints_on_every_encoding() -> None:
    rec = record_from_instance(_inst(GPU, DEDICATED), validate_instance(_inst(GPU, DEDICATED)))
    want = [("nvidia.com/gpu", "present", "NoSchedule"), ("dedicated", "", "PreferNoSchedule")]
    pb = rec.to_proto()
    assert [(t.key, t.value, t.effect) for t in pb.taints] == want
    cached = provider_pb2.Machine.FromString(rec.wire())  # the hand-assembled List bytes
    assert cached == pb
    rec.state = State.IDLE
    rec.touch(1)
    assert provider_pb2.Machine.FromString(rec.wire()).taints == pb.taints
    again = MachineRecord.from_json(rec.to_json())
    assert again.taints == (GPU, DEDICATED) and again.copy().taints == (GPU, DEDICATED)
    plain = record_from_instance(_inst(), State.SPECULATIVE)
    assert "taints" not in plain.to_json() and not plain.to_proto().taints


@pytest.mark.parametrize("bad", [Taint("", "NoSchedule"), Taint("k", "NoWay"), Taint("k", "")])
def test_malformed_taints_are_refused(bad: Taint) -> None:
    with pytest.raises(InvalidRecord, match="taint"):
        validate_instance(_inst(bad))


def test_fake_provider_flag_spelling() -> None:
    assert _taint("nvidia.com/gpu=present:NoSchedule") == GPU
    assert _taint("dedicated:PreferNoSchedule") == DEDICATED
    assert _taint("a=b:c:NoExecute") == Taint("a", "NoExecute", "b:c")
    for bad in ("nokey", ":NoSchedule", "k=v:Sometimes", "k=v"):
        with pytest.raises(argparse.ArgumentTypeError):
            _taint(bad)


def test_node_state_update_forwards_the_machines_taints() -> None:
    pb = record_from_instance(_inst(GPU), State.SPECULATIVE).to_proto()
    u = node_state_update(pb, "c1").node_state_update
    assert [(t.key, t.value, t.effect) for t in u.taints] == [("nvidia.com/gpu", "present", "NoSchedule")]
    assert not node_state_update(record_from_instance(_inst(), State.SPECULATIVE).to_proto(), "c1") \
        .node_state_update.taints


def test_conformance_shape_check_validates_declared_taints() -> None:
    from bigfleet.provider.conformance.checks import shape_problems

    m = provider_pb2.Machine(id="x", state=provider_pb2.MACHINE_STATE_SPECULATIVE, instance_type="t",
                             taints=[provider_pb2.NodeTaint(key="k", effect="Sometimes")])
    assert any("taint" in p for p in shape_problems(m))
    m.taints[0].effect = "NoExecute"
    assert shape_problems(m) == []


@pytest.mark.slow
def test_fake_provider_with_taints_passes_the_shape_check() -> None:
    import subprocess
    import sys

    from bigfleet.testing import ManagedProcess, free_port, wait_for_health

    addr = f"127.0.0.1:{free_port()}"
    p = ManagedProcess.bigfleet(["fake-provider", "--listen", addr, "--seed-count", "4", "--committed-count", "2",
                                 "--node-taint", "gpu=yes:NoSchedule"], "provider").start()
    try:
        wait_for_health(addr, 60)
        r = subprocess.run([sys.executable, "-m", "bigfleet.cli.main", "conformance", "--target", addr, "--only",
                            "C501,C101", "--quiet"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "2 passed" in r.stdout, r.stdout + r.stderr
    finally:
        p.stop()
