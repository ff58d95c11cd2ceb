"""Provider Machine proto ↔ Machine: validation, round trips, shard_metadata encoding."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigfleet.machine import (
    Assignment,
    CapacityType,
    Machine,
    MachineState,
    ValidationError,
    rejection_reason,
)
from bigfleet.needs import PenaltyBucket, bucket_dollars
from bigfleet.v1alpha1 import provider_pb2
from bigfleet.wire.machine import (
    META_ASSIGNED_PRIORITY,
    META_GROUP,
    META_INTERRUPTION_PENALTY,
    META_NEED_FINGERPRINT,
    META_RECLAMATION_PENALTY,
    decode_shard_metadata,
    encode_shard_metadata,
    format_go_float,
    machine_from_proto,
    machine_to_proto,
    parse_go_float,
)

from .helpers import label_text, resources, valid_machine

S = MachineState


def pb_machine(**over: Any) -> provider_pb2.Machine:
    kw: dict[str, Any] = {
        "id": "m-1",
        "state": 5,
        "host": provider_pb2.HostRef(provider="aws", ref="i-1"),
        "instance_type": "m5.xlarge",
        "zone": "eu-1a",
        "capacity_type": 3,
        "price_per_hour": 0.192,
        "interruption_probability": 0.05,
        "resources": provider_pb2.Resources(resources={"cpu": "4", "memory": "16Gi"}),
        "labels": {"pool": "general"},
        "allocatable": provider_pb2.Resources(resources={"cpu": "3800m"}),
        "cluster": "c1",
        "shard_metadata": {
            META_ASSIGNED_PRIORITY: "1000",
            META_INTERRUPTION_PENALTY: "8",
            META_RECLAMATION_PENALTY: "0.5",
            META_NEED_FINGERPRINT: "abc123",
            "example.com/unknown": "kept by provider, ignored by us",
        },
    }
    kw.update(over)
    return provider_pb2.Machine(**kw)


def test_from_proto() -> None:
    m = machine_from_proto(pb_machine(), now_unix_nanos=42)
    assert (m.id, m.state, m.cluster, m.host_provider, m.host_ref) == ("m-1", S.CONFIGURED, "c1", "aws", "i-1")
    assert m.capacity_type is CapacityType.ON_DEMAND and m.price_per_hour == 0.192
    assert m.interruption_probability == 0.05 and m.labels == {"pool": "general"}
    assert m.resources.get("cpu") == 4000 and m.allocatable.get("cpu") == 3800
    assert m.effective_allocatable.get("cpu") == 3800
    assert m.assigned_priority == 1000 and m.assigned_interruption_penalty_dollars == 8.0
    assert m.assigned_reclamation_penalty_dollars == 0.5 and m.assigned_need_fingerprint == "abc123"
    assert m.state_since_unix_nanos == 42


@pytest.mark.parametrize(
    ("over", "field", "reason"),
    [
        ({"id": ""}, "id", "structural"),
        ({"id": "x" * 300}, "id", "structural"),
        ({"state": 0}, "state", "structural"),
        ({"state": 9}, "state", "structural"),
        ({"capacity_type": 5}, "capacity_type", "structural"),
        ({"price_per_hour": -1.0}, "price_per_hour", "price"),
        ({"price_per_hour": math.nan}, "price_per_hour", "price"),
        ({"price_per_hour": math.inf}, "price_per_hour", "price"),
        ({"interruption_probability": 1.5}, "interruption_probability", "interruption_probability"),
        ({"interruption_probability": -0.0001}, "interruption_probability", "interruption_probability"),
        ({"interruption_probability": math.nan}, "interruption_probability", "interruption_probability"),
        ({"resources": provider_pb2.Resources(resources={"cpu": "four"})}, 'resources["cpu"]', "structural"),
        ({"resources": provider_pb2.Resources(resources={"cpu": "-4"})}, 'resources["cpu"]', "structural"),
        ({"allocatable": provider_pb2.Resources(resources={"mem": "1GB"})}, 'allocatable["mem"]', "structural"),
        ({"labels": {"pool": "v" * 64}}, 'labels["pool"]', "structural"),
        ({"labels": {"": "x"}}, 'labels[""]', "structural"),
        ({"labels": {"a b": "x"}}, 'labels["a b"]', "structural"),
        ({"labels": {f"k{i}": "v" for i in range(300)}}, "labels", "structural"),
        ({"cluster": ""}, "cluster", "structural"),  # CONFIGURED needs a cluster
        ({"state": 3}, "cluster", "structural"),  # IDLE must not have one
        ({"state": 1}, "host", "structural"),  # SPECULATIVE must not have a host
        ({"host": None}, "host", "structural"),
        ({"state": 8, "last_error": ""}, "last_error", "structural"),
        ({"zone": "z\x00"}, "zone", "structural"),
    ],
)
def test_from_proto_rejects(over: dict[str, Any], field: str, reason: str) -> None:
    pb = pb_machine(**{k: v for k, v in over.items() if v is not None})
    if "host" in over and over["host"] is None:
        pb.ClearField("host")
    with pytest.raises(ValidationError) as ei:
        machine_from_proto(pb)
    assert ei.value.field == field, str(ei.value)
    assert rejection_reason(ei.value) == reason


def test_failed_with_error_and_creating_are_accepted() -> None:
    m = machine_from_proto(pb_machine(state=8, last_error="kaboom", shard_metadata={}))
    assert m.state is S.FAILED and m.last_error == "kaboom"
    m = machine_from_proto(pb_machine(state=2, cluster="", shard_metadata={}, host=provider_pb2.HostRef()))
    assert m.state is S.CREATING and not m.has_host


def test_malformed_metadata_is_skipped_not_fatal() -> None:
    md = {
        META_ASSIGNED_PRIORITY: "high",
        META_INTERRUPTION_PENALTY: "NaN",
        META_RECLAMATION_PENALTY: "-3",
        META_NEED_FINGERPRINT: "fp",
        META_GROUP: "g\x01",
    }
    m = machine_from_proto(pb_machine(shard_metadata=md))
    assert m.assigned_priority == 0 and m.assigned_interruption_penalty_dollars == 0.0
    assert m.assigned_reclamation_penalty_dollars == 0.0 and m.assigned_need_fingerprint == "fp"
    assert m.assigned_group == ""
    d = decode_shard_metadata(md)
    assert set(d.malformed) == {META_ASSIGNED_PRIORITY, META_INTERRUPTION_PENALTY, META_RECLAMATION_PENALTY, META_GROUP}


def test_decode_each_key_on_its_own() -> None:
    d = decode_shard_metadata({META_ASSIGNED_PRIORITY: "-5", META_RECLAMATION_PENALTY: "+Inf"})
    assert d.priority == -5 and d.reclamation_penalty_dollars == math.inf
    assert d.interruption_penalty_dollars is None and d.need_fingerprint is None and d.malformed == ()
    base = Assignment(7, 1.0, 2.0, "old", "grp")
    a = d.apply_to(base)
    assert (a.priority, a.interruption_penalty_dollars, a.reclamation_penalty_dollars, a.need_fingerprint, a.group) == (
        -5, 1.0, math.inf, "old", "grp"
    )
    assert decode_shard_metadata({META_ASSIGNED_PRIORITY: str(2**31)}).priority is None


def test_encode_metadata() -> None:
    md = encode_shard_metadata(Assignment(1000, 8388608.0, math.inf, "fp", "g"))
    assert md == {
        META_ASSIGNED_PRIORITY: "1000",
        META_INTERRUPTION_PENALTY: "8.388608e+06",
        META_RECLAMATION_PENALTY: "+Inf",
        META_NEED_FINGERPRINT: "fp",
        META_GROUP: "g",
    }
    assert META_GROUP not in encode_shard_metadata(Assignment(1, 0.5, 0.0, "fp"))


@pytest.mark.parametrize(
    ("x", "go"),
    [
        (0.0, "0"),
        (0.5, "0.5"),
        (1.0, "1"),
        (8.0, "8"),
        (524288.0, "524288"),
        (999999.0, "999999"),
        (1e6, "1e+06"),
        (1048576.0, "1.048576e+06"),
        (8388608.0, "8.388608e+06"),
        (0.0001, "0.0001"),
        (0.00001, "1e-05"),
        (1.5e-7, "1.5e-07"),
        (123.456, "123.456"),
        (1e21, "1e+21"),
        (1e100, "1e+100"),
        (math.inf, "+Inf"),
        (-math.inf, "-Inf"),
        (-2.5, "-2.5"),
    ],
)
def test_go_float_format(x: float, go: str) -> None:
    assert format_go_float(x) == go
    assert parse_go_float(go) == x


def test_every_bucket_bound_round_trips_through_metadata() -> None:
    for b in PenaltyBucket:
        d = bucket_dollars(b)
        assert parse_go_float(format_go_float(d)) == d


@settings(deadline=None)
@given(st.floats(allow_nan=False))
def test_go_float_round_trip(x: float) -> None:
    assert parse_go_float(format_go_float(x)) == x


@pytest.mark.parametrize("bad", ["", "abc", "1,5", "0x10", "nan", "NaN"])
def test_parse_go_float_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        v = parse_go_float(bad)
        if math.isnan(v):
            raise ValueError("nan")


def test_to_proto() -> None:
    m = valid_machine("m", S.CONFIGURED, assigned_priority=3, assigned_need_fingerprint="fp")
    pb = machine_to_proto(m, extra_metadata={"x/y": "z"})
    assert pb.state == 5 and pb.host.ref == "h-m" and pb.cluster == "c1" and pb.resources.resources["cpu"] == "4"
    assert pb.shard_metadata[META_ASSIGNED_PRIORITY] == "3" and pb.shard_metadata["x/y"] == "z"
    assert not pb.HasField("allocatable")
    idle = machine_to_proto(valid_machine("i", S.IDLE))
    assert dict(idle.shard_metadata) == {}  # nothing stamped on an unbound, unassigned machine
    assert not machine_to_proto(valid_machine("s", S.SPECULATIVE)).HasField("host")


@st.composite
def machines(draw: st.DrawFn) -> Machine:
    state = draw(st.sampled_from([s for s in S if s is not S.UNSPECIFIED]))
    over: dict[str, Any] = {
        "price_per_hour": draw(st.floats(min_value=0, max_value=1e6, allow_nan=False)),
        "interruption_probability": draw(st.floats(min_value=0, max_value=1)),
        "capacity_type": draw(st.sampled_from(list(CapacityType))),
        "labels": draw(st.dictionaries(label_text, label_text, max_size=4)),
        "resources": draw(resources),
        "allocatable": draw(resources),
        "instance_type": draw(st.sampled_from(["", "m5.large", "p4d"])),
        "zone": draw(st.sampled_from(["", "z1"])),
    }
    if state in (S.CONFIGURING, S.CONFIGURED, S.DRAINING, S.FAILED, S.CREATING):
        over["assigned_priority"] = draw(st.integers(-(2**31), 2**31 - 1))
        over["assigned_interruption_penalty_dollars"] = bucket_dollars(draw(st.sampled_from(list(PenaltyBucket))))
        over["assigned_reclamation_penalty_dollars"] = draw(st.floats(min_value=0, allow_nan=False))
        over["assigned_need_fingerprint"] = draw(st.sampled_from(["", "0123abcd" * 4]))
        over["assigned_group"] = draw(st.sampled_from(["", "gang"]))
    if state is S.FAILED:
        over["last_error"] = draw(st.text(min_size=1, max_size=30).filter(lambda s: s.isprintable()))
        over["cluster"] = draw(st.sampled_from(["", "c9"]))
    return valid_machine(draw(st.text(alphabet="abc-0123456789", min_size=1, max_size=20)), state, **over)


@settings(deadline=None, max_examples=100)
@given(machines())
def test_round_trip_property(m: Machine) -> None:
    pb = machine_to_proto(m)
    back = machine_from_proto(provider_pb2.Machine.FromString(pb.SerializeToString()))
    # Assigned fields survive through shard_metadata only when something was stamped (or bound).
    assert back == m
    assert machine_to_proto(back) == pb


def test_node_name_from_hostname_label_or_metadata() -> None:
    from bigfleet.wire.machine import HOSTNAME_LABEL, META_NODE_NAME

    m = machine_from_proto(pb_machine(labels={HOSTNAME_LABEL: "ip-10-0-0-1"}, shard_metadata={META_NODE_NAME: "other"}))
    assert m.node_name == "ip-10-0-0-1" and m.reclaim_name == "ip-10-0-0-1"
    m = machine_from_proto(pb_machine(shard_metadata={META_NODE_NAME: "node-7"}))
    assert m.node_name == "node-7"
    m = machine_from_proto(pb_machine(shard_metadata={}))
    assert m.node_name == "" and m.reclaim_name == "m-1"  # decision 7: fall back to the machine id
    pb = machine_to_proto(m.replace(node_name="learned"))
    assert pb.shard_metadata[META_NODE_NAME] == "learned"
    pb = machine_to_proto(m.replace(node_name="h", labels={HOSTNAME_LABEL: "h"}))
    assert META_NODE_NAME not in pb.shard_metadata  # the provider already reports it


def test_separate_interners_build_equal_machines() -> None:
    from bigfleet.machine import Interner

    a = machine_from_proto(pb_machine(), interner=Interner())
    b = machine_from_proto(pb_machine(), interner=Interner())
    assert a == b and a.shape is not b.shape
    c = machine_from_proto(pb_machine())
    d = machine_from_proto(pb_machine())
    assert c == a and c.shape is d.shape and c.assignment is d.assignment


def test_invalid_labels_are_rejected_every_time() -> None:
    for _ in range(2):
        with pytest.raises(ValidationError):
            machine_from_proto(pb_machine(labels={"pool": "v" * 64}))
