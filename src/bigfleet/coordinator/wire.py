"""Conversions between the replicated state's JSON forms and coordinator.proto messages."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from google.protobuf import json_format

from bigfleet.coordinator.state import Instruction, Transfer
from bigfleet.v1alpha1 import capacity_pb2, coordinator_pb2, provider_pb2

pb = coordinator_pb2


def requirements_to_json(reqs: Iterable[capacity_pb2.NodeSelectorRequirement]) -> list[dict[str, Any]]:
    return [json_format.MessageToDict(r, preserving_proto_field_name=True) for r in reqs]


def requirements_from_json(items: Iterable[Mapping[str, Any]]) -> list[capacity_pb2.NodeSelectorRequirement]:
    out = []
    for item in items:
        msg = capacity_pb2.NodeSelectorRequirement()
        json_format.ParseDict(dict(item), msg, ignore_unknown_fields=True)
        out.append(msg)
    return out


def resources_to_json(res: provider_pb2.Resources) -> dict[str, str]:
    return dict(res.resources)


def instruction_to_proto(ins: Instruction, term: int) -> coordinator_pb2.CoordinatorInstruction:
    p = ins.payload
    out = pb.CoordinatorInstruction(coordinator_term=term, sequence_number=ins.sequence, instruction_id=ins.instruction_id)
    kind = p.get("kind")
    if kind == "assign_domain":
        out.assign_domain.CopyFrom(pb.AssignDomain(topology_key=p["topology_key"], topology_value=p["topology_value"]))
    elif kind == "unassign_domain":
        out.unassign_domain.CopyFrom(pb.UnassignDomain(topology_key=p["topology_key"], topology_value=p["topology_value"]))
    elif kind == "release_cluster":
        out.release_cluster.CopyFrom(
            pb.ReleaseCluster(
                cluster_id=p["cluster_id"],
                handoff_id=p["handoff_id"],
                to_shard_id=p["to_shard_id"],
                to_shard_address=p.get("to_shard_address", ""),
                binding_epoch=int(p.get("binding_epoch", 0)),
            )
        )
    elif kind == "adopt_cluster":
        out.adopt_cluster.CopyFrom(
            pb.AdoptCluster(
                cluster_id=p["cluster_id"],
                handoff_id=p["handoff_id"],
                from_shard_id=p["from_shard_id"],
                machine_ids=list(p.get("machine_ids", [])),
                binding_epoch=int(p.get("binding_epoch", 0)),
            )
        )
    elif kind == "transfer_ownership":
        out.transfer_ownership.CopyFrom(
            pb.TransferOwnership(
                machine_ids=list(p.get("machine_ids", [])),
                from_shard_id=p.get("from_shard_id", ""),
                to_shard_id=p.get("to_shard_id", ""),
                transfer_id=p.get("transfer_id", ""),
                requirements=requirements_from_json(p.get("requirements", [])),
                deficit=provider_pb2.Resources(resources=dict(p.get("deficit", {}))),
                min_unit=provider_pb2.Resources(resources=dict(p.get("min_unit", {}))),
            )
        )
    elif kind == "cross_shard_drain":
        out.cross_shard_drain.CopyFrom(
            pb.CrossShardDrain(
                machine_ids=list(p.get("machine_ids", [])),
                preemptor_priority=int(p.get("preemptor_priority", 0)),
                to_shard_id=p.get("to_shard_id", ""),
                transfer_id=p.get("transfer_id", ""),
                requirements=requirements_from_json(p.get("requirements", [])),
                deficit=provider_pb2.Resources(resources=dict(p.get("deficit", {}))),
                min_unit=provider_pb2.Resources(resources=dict(p.get("min_unit", {}))),
            )
        )
    elif kind == "reassign_speculative":
        out.reassign_speculative.CopyFrom(pb.ReassignSpeculative(machine_ids=list(p.get("machine_ids", []))))
    return out


def transfer_to_proto(t: Transfer) -> coordinator_pb2.TransferStatus:
    return pb.TransferStatus(
        transfer_id=t.transfer_id,
        kind=t.kind,
        from_shard_id=t.from_shard,
        to_shard_id=t.to_shard,
        cluster_id=t.cluster_id,
        phase=t.phase,
        machine_ids=list(t.machine_ids),
        created_at_unix_ns=t.created_at_ns,
        updated_at_unix_ns=t.updated_at_ns,
        reason=t.reason,
    )
