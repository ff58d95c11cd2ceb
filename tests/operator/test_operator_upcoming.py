"""Pure mapping of NodeStateUpdate / AvailableCapacityUpdate onto the CRs."""

from __future__ import annotations

import hashlib
import re

import pytest

from bigfleet.operator.bootstrap import BootstrapRenderer
from bigfleet.operator.upcoming import (
    PHASE_BY_STATE,
    available_capacity_name,
    available_capacity_object,
    dns_subdomain,
    plan_upcoming,
    upcoming_name,
)
from bigfleet.v1alpha1 import provider_pb2, shard_pb2

M = provider_pb2
DNS = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def u(state: int, mid: str = "m-1", **kw: object) -> shard_pb2.NodeStateUpdate:
    return shard_pb2.NodeStateUpdate(machine_id=mid, state=state, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("state", "phase"), [
    (M.MACHINE_STATE_SPECULATIVE, "Provisioning"), (M.MACHINE_STATE_CREATING, "Provisioning"),
    (M.MACHINE_STATE_IDLE, "Launched"), (M.MACHINE_STATE_CONFIGURING, "Registered"),
    (M.MACHINE_STATE_CONFIGURED, "Ready"), (M.MACHINE_STATE_DRAINING, "Draining"),
    (M.MACHINE_STATE_FAILED, "Failed"), (M.MACHINE_STATE_DELETING, "Provisioning"),
])
def test_phase_mapping(state: int, phase: str) -> None:
    assert PHASE_BY_STATE.get(state, "Provisioning") == phase
    p = plan_upcoming(u(state), None, "T")
    assert p.create and p.phase == phase and p.status == {"phase": phase, "provisioningStartTime": "T"}


def test_names_are_valid_and_collision_free() -> None:
    assert upcoming_name("m-1") == "un-m-1"
    a, b = upcoming_name("Node_A"), upcoming_name("node-a")
    assert a != b and DNS.match(a) and DNS.match(b)
    long = dns_subdomain("un-", "x" * 400)
    assert len(long) <= 253 and DNS.match(long)
    key = "available:fp/1"
    assert available_capacity_name(key) == "ac-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def test_unchanged_frames_write_nothing_and_idle_after_drain_finishes_it() -> None:
    cur = {"spec": {"labels": {}, "resources": {"cpu": "4"}},
           "status": {"phase": "Ready", "provisioningStartTime": "T0", "nodeRef": {"kind": "Node", "name": "n"}}}
    p = plan_upcoming(u(M.MACHINE_STATE_CONFIGURED, node_name="n",
                        resources=provider_pb2.Resources(resources={"cpu": "4000m"})), cur, "T1")
    assert p.spec is None and p.status is None and not p.create and not p.delete
    draining = {**cur, "status": {**cur["status"], "phase": "Draining"}}
    p = plan_upcoming(u(M.MACHINE_STATE_IDLE), draining, "T1")
    assert p.delete and p.status == {"phase": "Drained"}
    # The Idle frame that follows a completed drain (CR already deleted) must not recreate it...
    assert plan_upcoming(u(M.MACHINE_STATE_IDLE), None, "T", drained=True).create is False
    # ...but a machine being brought (back) to the cluster is created normally.
    assert plan_upcoming(u(M.MACHINE_STATE_CREATING), None, "T", drained=True).create is True


def test_available_capacity_object() -> None:
    assert available_capacity_object(shard_pb2.AvailableCapacityUpdate()) is None
    obj = available_capacity_object(shard_pb2.AvailableCapacityUpdate(
        supersedes_key="available:x", available_count=-3, cost_per_hour=float("nan"),
        confidence=shard_pb2.AvailableCapacityUpdate.CONFIDENCE_MEDIUM,
        resources=provider_pb2.Resources(resources={"cpu": "2", "bad": "??"})))
    assert obj is not None
    assert obj["spec"] == {"availability": "Medium", "availableCount": 0, "cost": "0", "requirements": [],
                           "resources": {"cpu": "2"}}


def test_bootstrap_stub_and_template_errors() -> None:
    req = shard_pb2.BootstrapRequest(request_id="r1", cluster_id="c1")
    stub = BootstrapRenderer().render(req, "c1")
    assert stub.user_data == b"#cloud-config\n# bigfleet stub bootstrap for c1\n" and stub.ttl_seconds == 600
    broken = BootstrapRenderer("{{ NoSuchField }}").render(req, "c1")
    assert broken.error.startswith("bootstrap template failed") and not broken.user_data
    wrong = BootstrapRenderer("x").render(shard_pb2.BootstrapRequest(request_id="r", cluster_id="other"), "c1")
    assert "other" in wrong.error
