"""The generated descriptors match the wire contract in protocols.md §2–§6.

Every fact below is transcribed from the spec (not from our .proto files), so an edit that renumbers,
retypes, renames or drops anything the Go BigFleet speaks fails here. Additions (new fields, messages
and RPCs with new numbers) are allowed and ignored.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor

from bigfleet.v1alpha1 import (
    capacity_pb2,
    capacity_pb2_grpc,
    coordinator_pb2,
    coordinator_pb2_grpc,
    provider_pb2,
    provider_pb2_grpc,
    shard_pb2,
    shard_pb2_grpc,
    shardread_pb2,
    shardread_pb2_grpc,
)

PKG = "bigfleet.v1alpha1"

# --- field table -------------------------------------------------------------------------------
# message -> field -> (number, type[, oneof]). Types: scalar names, "map<K,V>", "repeated T", or a
# message/enum name relative to the package (nested ones as "Outer.Inner").

MESSAGES: dict[str, dict[str, dict[str, tuple[Any, ...]]]] = {
    "capacity": {
        "ClusterCapacityNeeds": {
            "cluster_id": (1, "string"),
            "timestamp_unix_nanos": (2, "int64"),
            "needs": (3, "repeated CapacityNeed"),
        },
        "CapacityNeed": {
            "requirements": (1, "repeated NodeSelectorRequirement"),
            "aggregate_resources": (2, "map<string,string>"),
            "priority": (3, "int32"),
            "spread": (5, "repeated TopologySpread"),
            "interruption_penalty_bucket": (6, "PenaltyBucket"),
            "reclamation_penalty_bucket": (7, "PenaltyBucket"),
            "min_unit": (8, "map<string,string>"),
            "group": (9, "string"),
        },
        "NodeSelectorRequirement": {
            "key": (1, "string"),
            "operator": (2, "NodeSelectorRequirement.Operator"),
            "values": (3, "repeated string"),
        },
        "TopologySpread": {
            "topology_key": (1, "string"),
            "max_skew": (2, "int32"),
            "when_unsatisfiable": (3, "TopologySpread.WhenUnsatisfiable"),
        },
    },
    "shard": {
        "OperatorMessage": {
            "hello": (1, "Hello", "payload"),
            "rollup": (2, "ClusterCapacityNeeds", "payload"),
            "bootstrap_response": (3, "BootstrapBlobResponse", "payload"),
            "reclaim_ack": (4, "ReclaimAck", "payload"),
        },
        "ShardMessage": {
            "ack": (1, "Acknowledgement", "payload"),
            "bootstrap_request": (2, "BootstrapRequest", "payload"),
            "reclaim_instruction": (3, "ReclaimInstruction", "payload"),
            "node_state_update": (4, "NodeStateUpdate", "payload"),
            "available_capacity": (5, "AvailableCapacityUpdate", "payload"),
        },
        "Hello": {"cluster_id": (1, "string"), "protocol_version": (3, "string")},
        "Acknowledgement": {
            "echo": (1, "string"),
            "coordinator_term": (2, "int64"),
            "shard_epoch": (3, "int64"),
        },
        "BootstrapRequest": {
            "request_id": (1, "string"),
            "requirements": (2, "repeated NodeSelectorRequirement"),
            "cluster_id": (3, "string"),
        },
        "BootstrapBlobResponse": {
            "request_id": (1, "string"),
            "user_data": (2, "bytes"),
            "ttl_seconds": (3, "int64"),
            "error": (4, "string"),
        },
        "ReclaimInstruction": {
            "instruction_id": (1, "string"),
            "nodes": (2, "repeated string"),
            "grace_period_seconds": (3, "int64"),
            "preemptor_priority": (4, "int32"),
        },
        "ReclaimAck": {"instruction_id": (1, "string"), "nodes_started": (2, "int32")},
        "NodeStateUpdate": {
            "supersedes_key": (1, "string"),
            "machine_id": (2, "string"),
            "cluster_id": (3, "string"),
            "state": (4, "MachineState"),
            "node_name": (5, "string"),
            "provider_id": (6, "string"),
            "last_error": (8, "string"),
            "labels": (9, "map<string,string>"),
            "resources": (10, "Resources"),
            "taints": (11, "repeated Taint"),
        },
        "Taint": {"key": (1, "string"), "value": (2, "string"), "effect": (3, "string")},
        "AvailableCapacityUpdate": {
            "supersedes_key": (1, "string"),
            "requirements": (2, "repeated NodeSelectorRequirement"),
            "resources": (3, "Resources"),
            "available_count": (4, "int32"),
            "confidence": (5, "AvailableCapacityUpdate.Confidence"),
            "cost_per_hour": (6, "double"),
        },
    },
    "provider": {
        "HostRef": {"provider": (1, "string"), "ref": (2, "string")},
        "Resources": {"resources": (1, "map<string,string>")},
        "Machine": {
            "id": (1, "string"),
            "state": (2, "MachineState"),
            "host": (3, "HostRef"),
            "instance_type": (4, "string"),
            "zone": (5, "string"),
            "capacity_type": (6, "CapacityType"),
            "price_per_hour": (7, "double"),
            "interruption_probability": (8, "double"),
            "resources": (9, "Resources"),
            "labels": (10, "map<string,string>"),
            "last_error": (12, "string"),
            "allocatable": (13, "Resources"),
            "cluster": (14, "string"),
            "shard_metadata": (15, "map<string,string>"),
        },
        "MachineRef": {"id": (1, "string")},
        "MachineList": {"machines": (1, "repeated Machine"), "revision": (2, "bytes")},
        "ListFilter": {
            "states": (1, "repeated MachineState"),
            "max_results": (4, "int32"),
            "since_revision": (5, "bytes"),
        },
        "CreateRequest": {
            "machine_id": (1, "string"),
            "shard_id": (3, "string"),
            "shard_epoch": (4, "int64"),
            "sequence_number": (5, "int64"),
        },
        "ConfigureRequest": {
            "machine_id": (1, "string"),
            "cluster_id": (2, "string"),
            "bootstrap_blob": (3, "bytes"),
            "shard_id": (4, "string"),
            "shard_epoch": (5, "int64"),
            "sequence_number": (6, "int64"),
            "shard_metadata": (7, "map<string,string>"),
        },
        "DrainRequest": {
            "machine_id": (1, "string"),
            "grace_period_seconds": (2, "int64"),
            "shard_id": (3, "string"),
            "shard_epoch": (4, "int64"),
            "sequence_number": (5, "int64"),
        },
        "DeleteRequest": {
            "machine_id": (1, "string"),
            "shard_id": (2, "string"),
            "shard_epoch": (3, "int64"),
            "sequence_number": (4, "int64"),
        },
        "TransitionAck": {"operation_id": (1, "string"), "machine": (2, "Machine")},
    },
    "coordinator": {
        "ShardReport": {
            "shard_id": (1, "string"),
            "cycle": (2, "int64"),
            "timestamp_unix_nanos": (3, "int64"),
            "shard_epoch": (4, "int64"),
            "summary": (5, "ShardSummary"),
            "shortfalls": (6, "repeated Shortfall"),
            "instruction_acks": (7, "repeated InstructAck"),
            "shard_address": (8, "string"),
        },
        "ShardSummary": {
            "total_machines": (1, "int32"),
            "free_machines": (2, "int32"),
            "per_instance_type_counts": (3, "map<string,int32>"),
            "per_zone_counts": (4, "map<string,int32>"),
            "provider_address": (7, "string"),
        },
        "Shortfall": {
            "requirements": (1, "repeated NodeSelectorRequirement"),
            "deficit": (2, "Resources"),
            "priority": (3, "int32"),
            "age_cycles": (5, "int32"),
            "interruption_penalty_bucket": (6, "PenaltyBucket"),
        },
        "ReportAck": {
            "coordinator_term": (1, "int64"),
            "acknowledged": (2, "bool"),
            "instructions": (3, "repeated CoordinatorInstruction"),
        },
        "CoordinatorInstruction": {
            "coordinator_term": (1, "int64"),
            "sequence_number": (2, "int64"),
            "instruction_id": (3, "string"),
            "assign_domain": (4, "AssignDomain", "payload"),
            "unassign_domain": (5, "UnassignDomain", "payload"),
            "reassign_speculative": (6, "ReassignSpeculative", "payload"),
            "cross_shard_drain": (7, "CrossShardDrain", "payload"),
            "transfer_ownership": (8, "TransferOwnership", "payload"),
        },
        "AssignDomain": {"topology_key": (1, "string"), "topology_value": (2, "string")},
        "UnassignDomain": {"topology_key": (1, "string"), "topology_value": (2, "string")},
        "ReassignSpeculative": {"machine_ids": (1, "repeated string")},
        "CrossShardDrain": {"machine_ids": (1, "repeated string"), "preemptor_priority": (2, "int32")},
        "TransferOwnership": {
            "machine_ids": (1, "repeated string"),
            "from_shard_id": (2, "string"),
            "to_shard_id": (3, "string"),
        },
        "InstructAck": {
            "instruction_id": (1, "string"),
            "outcome": (2, "InstructAck.Outcome"),
            "reason": (3, "string"),
        },
        "AssignDomainRequest": {
            "topology_key": (1, "string"),
            "topology_value": (2, "string"),
            "shard_id": (3, "string"),
        },
        "AssignDomainResponse": {},
        "UnassignDomainRequest": {"topology_key": (1, "string"), "topology_value": (2, "string")},
        "UnassignDomainResponse": {},
        "RemoveShardRequest": {"shard_id": (1, "string")},
        "RemoveShardResponse": {},
        "ListShardsRequest": {},
        "ListShardsResponse": {"shards": (1, "repeated ShardRegistryEntry")},
        "ShardRegistryEntry": {
            "shard_id": (1, "string"),
            "address": (2, "string"),
            "registered_at_unix_ns": (3, "int64"),
            "last_heartbeat_unix_ns": (4, "int64"),
        },
        "ListDomainAssignmentsRequest": {},
        "ListDomainAssignmentsResponse": {"assignments": (1, "repeated DomainAssignment")},
        "DomainAssignment": {
            "topology_key": (1, "string"),
            "topology_value": (2, "string"),
            "shard_id": (3, "string"),
        },
        "ListShardReportsRequest": {"shard_id": (1, "string")},
        "ListShardReportsResponse": {"reports": (1, "repeated ShardReportSnapshot")},
        "ShardReportSnapshot": {
            "shard_id": (1, "string"),
            "cycle": (2, "int64"),
            "received_at_unix_ns": (3, "int64"),
            "summary": (4, "ShardSummary"),
            "shortfalls": (5, "repeated Shortfall"),
        },
        "JoinRaftClusterRequest": {"node_id": (1, "string"), "raft_address": (2, "string")},
        "JoinRaftClusterResponse": {},
        "SnapshotSaveRequest": {},
        "SnapshotSaveChunk": {"meta_json": (1, "bytes", "payload"), "data": (2, "bytes", "payload")},
    },
    "shardread": {
        "InspectNeedsRequest": {"cluster_id": (1, "string"), "limit": (2, "int32")},
        "InspectNeedsResponse": {
            "header": (1, "InspectNeedsHeader", "frame"),
            "need": (2, "NeedView", "frame"),
        },
        "InspectNeedsHeader": {
            "cycle": (1, "int64"),
            "computed_at_unix_nanos": (2, "int64"),
            "total_needs": (3, "int32"),
        },
        "NeedView": {
            "need": (1, "CapacityNeed"),
            "cluster_id": (2, "string"),
            "arrival_unix_nanos": (3, "int64"),
            "profile_fingerprint": (4, "string"),
            "satisfied": (5, "bool"),
            "residual_deficit": (6, "Resources"),
            "claimed_machine_count": (7, "int32"),
            "bootstrap_count": (8, "int32"),
            "provision_count": (9, "int32"),
            "same_domain": (10, "string"),
            "same_satisfiable": (11, "bool"),
            "acquisition_parked": (12, "bool"),
            "parked_age_cycles": (13, "int32"),
            "age_cycles_unmet": (14, "int32"),
            "unmet_reason": (15, "UnmetReason"),
            "matching_supply": (16, "MatchingSupply"),
            "preemption": (17, "PreemptionSummary"),
            "same_candidates": (18, "repeated DomainCoverage"),
        },
        "MatchingSupply": {
            "idle": (1, "int32"),
            "configured": (2, "int32"),
            "speculative": (3, "int32"),
            "capped": (4, "bool"),
        },
        "PreemptionSummary": {"victims_found": (1, "int32"), "capacity_freed": (2, "Resources")},
        "DomainCoverage": {
            "domain": (1, "string"),
            "coverage_per_mille": (2, "int32"),
            "satisfiable": (3, "bool"),
        },
    },
}

# Tombstones (message -> reserved field numbers); never reusable.
RESERVED: dict[str, set[int]] = {
    "CapacityNeed": {4},
    "Hello": {2},
    "NodeStateUpdate": {7},
    "AvailableCapacityUpdate": {7, 8, 9},
    "Machine": {11},
    "ListFilter": {2, 3},
    "CreateRequest": {2},
    "ShardSummary": {5, 6},
    "Shortfall": {4},
}

_BUCKETS = [2**k for k in range(1, 24)]
ENUMS: dict[str, dict[str, int]] = {
    "NodeSelectorRequirement.Operator": {
        "OPERATOR_UNSPECIFIED": 0,
        "OPERATOR_IN": 1,
        "OPERATOR_NOT_IN": 2,
        "OPERATOR_EXISTS": 3,
        "OPERATOR_DOES_NOT_EXIST": 4,
        "OPERATOR_SAME": 5,
    },
    "TopologySpread.WhenUnsatisfiable": {
        "WHEN_UNSATISFIABLE_UNSPECIFIED": 0,
        "WHEN_UNSATISFIABLE_DO_NOT_SCHEDULE": 1,
        "WHEN_UNSATISFIABLE_SCHEDULE_ANYWAY": 2,
    },
    "PenaltyBucket": {
        "PENALTY_BUCKET_UNSPECIFIED": 0,
        "PENALTY_BUCKET_ZERO": 1,
        "PENALTY_BUCKET_HALF_DOLLAR": 2,
        "PENALTY_BUCKET_1": 3,
        **{f"PENALTY_BUCKET_{b}": 3 + k for k, b in enumerate(_BUCKETS, start=1)},
        "PENALTY_BUCKET_PINNED": 27,
    },
    "AvailableCapacityUpdate.Confidence": {
        "CONFIDENCE_UNSPECIFIED": 0,
        "CONFIDENCE_NONE": 1,
        "CONFIDENCE_LOW": 2,
        "CONFIDENCE_MEDIUM": 3,
        "CONFIDENCE_HIGH": 4,
    },
    "MachineState": {
        "MACHINE_STATE_UNSPECIFIED": 0,
        "MACHINE_STATE_SPECULATIVE": 1,
        "MACHINE_STATE_CREATING": 2,
        "MACHINE_STATE_IDLE": 3,
        "MACHINE_STATE_CONFIGURING": 4,
        "MACHINE_STATE_CONFIGURED": 5,
        "MACHINE_STATE_DRAINING": 6,
        "MACHINE_STATE_DELETING": 7,
        "MACHINE_STATE_FAILED": 8,
    },
    "CapacityType": {
        "CAPACITY_TYPE_UNSPECIFIED": 0,
        "CAPACITY_TYPE_BARE_METAL": 1,
        "CAPACITY_TYPE_RESERVED": 2,
        "CAPACITY_TYPE_ON_DEMAND": 3,
        "CAPACITY_TYPE_SPOT": 4,
    },
    "InstructAck.Outcome": {
        "OUTCOME_UNSPECIFIED": 0,
        "OUTCOME_ACCEPTED": 1,
        "OUTCOME_REJECTED_STALE": 2,
        "OUTCOME_REJECTED_INVALID": 3,
        "OUTCOME_FAILED": 4,
    },
    "UnmetReason": {
        "UNMET_REASON_UNSPECIFIED": 0,
        "UNMET_REASON_PRIORITY_STARVED": 1,
        "UNMET_REASON_NO_MATCHING_SUPPLY": 2,
        "UNMET_REASON_TOPOLOGY_UNSATISFIABLE": 3,
        "UNMET_REASON_PREEMPTION_EXHAUSTED": 4,
    },
}
# Which file each enum is declared in.
ENUM_FILES = {
    "NodeSelectorRequirement.Operator": "capacity",
    "TopologySpread.WhenUnsatisfiable": "capacity",
    "PenaltyBucket": "capacity",
    "AvailableCapacityUpdate.Confidence": "shard",
    "MachineState": "provider",
    "CapacityType": "provider",
    "InstructAck.Outcome": "coordinator",
    "UnmetReason": "shardread",
}

# service -> method -> (request, response, client_streaming, server_streaming)
SERVICES: dict[str, dict[str, dict[str, tuple[str, str, bool, bool]]]] = {
    "capacity": {},
    "shard": {"Shard": {"Session": ("OperatorMessage", "ShardMessage", True, True)}},
    "provider": {
        "CapacityProvider": {
            "Create": ("CreateRequest", "TransitionAck", False, False),
            "Configure": ("ConfigureRequest", "TransitionAck", False, False),
            "Drain": ("DrainRequest", "TransitionAck", False, False),
            "Delete": ("DeleteRequest", "TransitionAck", False, False),
            "Get": ("MachineRef", "Machine", False, False),
            "List": ("ListFilter", "MachineList", False, False),
        }
    },
    "coordinator": {
        "Coordinator": {
            "ReportShard": ("ShardReport", "ReportAck", False, False),
            "AssignDomain": ("AssignDomainRequest", "AssignDomainResponse", False, False),
            "UnassignDomain": ("UnassignDomainRequest", "UnassignDomainResponse", False, False),
            "RemoveShard": ("RemoveShardRequest", "RemoveShardResponse", False, False),
            "ListShards": ("ListShardsRequest", "ListShardsResponse", False, False),
            "ListDomainAssignments": ("ListDomainAssignmentsRequest", "ListDomainAssignmentsResponse", False, False),
            "ListShardReports": ("ListShardReportsRequest", "ListShardReportsResponse", False, False),
            "JoinRaftCluster": ("JoinRaftClusterRequest", "JoinRaftClusterResponse", False, False),
            "SnapshotSave": ("SnapshotSaveRequest", "SnapshotSaveChunk", False, True),
        }
    },
    "shardread": {"ShardRead": {"InspectNeeds": ("InspectNeedsRequest", "InspectNeedsResponse", False, True)}},
}

# Imports (§1): capacity and provider import nothing of ours; the others import both.
IMPORTS = {
    "capacity": set(),
    "provider": set(),
    "shard": {"bigfleet/v1alpha1/capacity.proto", "bigfleet/v1alpha1/provider.proto"},
    "coordinator": {"bigfleet/v1alpha1/capacity.proto", "bigfleet/v1alpha1/provider.proto"},
    "shardread": {"bigfleet/v1alpha1/capacity.proto", "bigfleet/v1alpha1/provider.proto"},
}

MODULES: dict[str, tuple[ModuleType, ModuleType]] = {
    "capacity": (capacity_pb2, capacity_pb2_grpc),
    "shard": (shard_pb2, shard_pb2_grpc),
    "provider": (provider_pb2, provider_pb2_grpc),
    "coordinator": (coordinator_pb2, coordinator_pb2_grpc),
    "shardread": (shardread_pb2, shardread_pb2_grpc),
}

_SCALARS = {
    "string": FieldDescriptor.TYPE_STRING,
    "bytes": FieldDescriptor.TYPE_BYTES,
    "bool": FieldDescriptor.TYPE_BOOL,
    "int32": FieldDescriptor.TYPE_INT32,
    "int64": FieldDescriptor.TYPE_INT64,
    "double": FieldDescriptor.TYPE_DOUBLE,
}


def _file(name: str) -> FileDescriptor:
    fd: FileDescriptor = MODULES[name][0].DESCRIPTOR
    return fd


def _rel(full_name: str) -> str:
    assert full_name.startswith(PKG + "."), full_name
    return full_name[len(PKG) + 1 :]


def _find_message(fd: FileDescriptor, name: str) -> Descriptor:
    parts = name.split(".")
    desc = fd.message_types_by_name[parts[0]]
    for p in parts[1:]:
        desc = desc.nested_types_by_name[p]
    return desc


def _check_type(where: str, f: FieldDescriptor, spec: str) -> None:
    repeated = False
    if spec.startswith("map<"):
        key_t, val_t = spec[4:-1].split(",")
        entry = f.message_type
        assert f.type == FieldDescriptor.TYPE_MESSAGE and entry is not None, f"{where}: not a message"
        assert entry.GetOptions().map_entry, f"{where}: not a map"
        _check_type(where + ".key", entry.fields_by_name["key"], key_t)
        _check_type(where + ".value", entry.fields_by_name["value"], val_t)
        return
    if spec.startswith("repeated "):
        repeated = True
        spec = spec[len("repeated ") :]
    assert f.is_repeated == repeated, f"{where}: repeated={f.is_repeated}, spec says {repeated}"
    if spec in _SCALARS:
        assert f.type == _SCALARS[spec], f"{where}: type {f.type}, spec says {spec}"
    elif spec in ENUMS:
        assert f.type == FieldDescriptor.TYPE_ENUM and f.enum_type is not None, f"{where}: not an enum"
        assert _rel(f.enum_type.full_name) == spec, f"{where}: enum {f.enum_type.full_name}, spec says {spec}"
    else:
        assert f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type is not None, f"{where}: not a message"
        assert not f.message_type.GetOptions().map_entry, f"{where}: is a map"
        assert _rel(f.message_type.full_name) == spec, f"{where}: message {f.message_type.full_name}, spec says {spec}"


def _field_cases() -> list[tuple[str, str, str, tuple[Any, ...]]]:
    return [
        (fname, msg, field, spec)
        for fname, msgs in MESSAGES.items()
        for msg, fields in msgs.items()
        for field, spec in fields.items()
    ]


@pytest.mark.parametrize("fname", sorted(MODULES))
def test_file_package_and_imports(fname: str) -> None:
    fd = _file(fname)
    assert fd.package == PKG
    assert fd.name == f"bigfleet/v1alpha1/{fname}.proto"
    ours = {d.name for d in fd.dependencies if d.name.startswith("bigfleet/")}
    if fname in ("capacity", "provider"):
        assert ours == set(), f"{fname}.proto must stay dependency-free"
    else:
        # Additive messages may bring more imports; the spec's must be there.
        assert IMPORTS[fname] <= ours
    proto = descriptor_pb2.FileDescriptorProto()
    fd.CopyToProto(proto)
    assert proto.syntax in ("proto3", "")  # CopyToProto leaves proto2 blank; proto3 is explicit


@pytest.mark.parametrize("fname", sorted(MODULES))
def test_every_spec_message_exists(fname: str) -> None:
    fd = _file(fname)
    for msg in MESSAGES[fname]:
        desc = fd.message_types_by_name.get(msg)
        assert desc is not None, f"{fname}.proto lacks message {msg}"
        assert desc.full_name == f"{PKG}.{msg}"


def test_field_table_covers_every_field() -> None:
    cases = _field_cases()
    assert len(cases) > 150  # the table above is the whole wire contract, not a sample


@pytest.mark.parametrize(("fname", "msg", "field", "spec"), _field_cases(), ids=lambda v: str(v))
def test_field(fname: str, msg: str, field: str, spec: tuple[Any, ...]) -> None:
    desc = _find_message(_file(fname), msg)
    f = desc.fields_by_name.get(field)
    assert f is not None, f"{msg} lacks field {field}"
    number, type_spec = spec[0], spec[1]
    assert f.number == number, f"{msg}.{field}: number {f.number}, spec says {number}"
    _check_type(f"{msg}.{field}", f, type_spec)
    oneof = spec[2] if len(spec) > 2 else None
    actual_oneof = f.containing_oneof.name if f.containing_oneof is not None else None
    # proto3 `optional` creates a synthetic oneof named "_<field>"; it is not a real oneof.
    if actual_oneof is not None and actual_oneof == "_" + field:
        actual_oneof = None
    assert actual_oneof == oneof, f"{msg}.{field}: oneof {actual_oneof}, spec says {oneof}"


@pytest.mark.parametrize(("msg", "numbers"), sorted(RESERVED.items()))
def test_reserved_numbers(msg: str, numbers: set[int]) -> None:
    desc = None
    for fname, msgs in MESSAGES.items():
        if msg in msgs:
            desc = _file(fname).message_types_by_name.get(msg)
            break
    assert desc is not None, msg
    proto = descriptor_pb2.DescriptorProto()
    desc.CopyToProto(proto)
    reserved = {n for r in proto.reserved_range for n in range(r.start, r.end)}
    assert numbers <= reserved, f"{msg}: reserved {sorted(reserved)}, spec says {sorted(numbers)}"
    used = {f.number for f in desc.fields}
    assert not (used & numbers), f"{msg} reuses a tombstone: {sorted(used & numbers)}"


def test_no_spec_message_reuses_a_spec_number() -> None:
    # An added field may not take a number the spec gives to a different field of the same message.
    for fname, msgs in MESSAGES.items():
        for msg, fields in msgs.items():
            desc = _find_message(_file(fname), msg)
            by_number = {spec[0]: name for name, spec in fields.items()}
            for f in desc.fields:
                if f.number in by_number:
                    assert f.name == by_number[f.number], f"{msg}: number {f.number} is {f.name}, spec {by_number[f.number]}"


@pytest.mark.parametrize("enum_name", sorted(ENUMS))
def test_enum_values(enum_name: str) -> None:
    fd = _file(ENUM_FILES[enum_name])
    parts = enum_name.split(".")
    if len(parts) == 1:
        ed = fd.enum_types_by_name[parts[0]]
    else:
        ed = _find_message(fd, ".".join(parts[:-1])).enum_types_by_name[parts[-1]]
    assert ed.full_name == f"{PKG}.{enum_name}"
    actual = {v.name: v.number for v in ed.values}
    for name, number in ENUMS[enum_name].items():
        assert actual.get(name) == number, f"{enum_name}.{name}: {actual.get(name)}, spec says {number}"
    # No added value may reuse a spec number under another name (aliases would change meaning).
    spec_by_number = {n: k for k, n in ENUMS[enum_name].items()}
    for name, number in actual.items():
        if number in spec_by_number:
            assert name == spec_by_number[number], f"{enum_name}: {name} reuses {number}"


def test_penalty_bucket_names_are_powers_of_two() -> None:
    values = ENUMS["PenaltyBucket"]
    assert len(values) == 28
    assert values["PENALTY_BUCKET_8388608"] == 26


@pytest.mark.parametrize("fname", sorted(MODULES))
def test_services_and_methods(fname: str) -> None:
    fd = _file(fname)
    spec = SERVICES[fname]
    for svc_name, methods in spec.items():
        svc = fd.services_by_name.get(svc_name)
        assert svc is not None, f"{fname}.proto lacks service {svc_name}"
        assert svc.full_name == f"{PKG}.{svc_name}"
        for mname, (req, resp, cs, ss) in methods.items():
            m = svc.methods_by_name.get(mname)
            assert m is not None, f"{svc_name} lacks {mname}"
            assert _rel(m.input_type.full_name) == req, f"{svc_name}.{mname} request"
            assert _rel(m.output_type.full_name) == resp, f"{svc_name}.{mname} response"
            assert m.client_streaming == cs, f"{svc_name}.{mname} client_streaming"
            assert m.server_streaming == ss, f"{svc_name}.{mname} server_streaming"
    if fname == "capacity":
        assert not fd.services_by_name


class _RecordingChannel:
    """Stands in for a grpc.Channel: records which multi-callable each stub method asks for."""

    def __init__(self) -> None:
        self.calls: dict[str, str] = {}

    def _record(self, kind: str) -> Any:
        def make(path: str, *args: Any, **kwargs: Any) -> object:
            self.calls[path] = kind
            return object()

        return make

    def __getattr__(self, kind: str) -> Any:
        if kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            return self._record(kind)
        raise AttributeError(kind)


@pytest.mark.parametrize("fname", sorted(m for m in MODULES if SERVICES[m]))
def test_generated_stubs_use_the_wire_paths(fname: str) -> None:
    grpc_mod = MODULES[fname][1]
    for svc_name, methods in SERVICES[fname].items():
        ch = _RecordingChannel()
        getattr(grpc_mod, f"{svc_name}Stub")(ch)
        for mname, (_, _, cs, ss) in methods.items():
            path = f"/{PKG}.{svc_name}/{mname}"
            kind = f"{'stream' if cs else 'unary'}_{'stream' if ss else 'unary'}"
            assert ch.calls.get(path) == kind, f"{path}: {ch.calls.get(path)}, spec says {kind}"
        assert hasattr(grpc_mod, f"{svc_name}Servicer")
        assert hasattr(grpc_mod, f"add_{svc_name}Servicer_to_server")
