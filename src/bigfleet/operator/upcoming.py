"""Pure mapping of shard frames onto the UpcomingNode and AvailableCapacity custom resources.

``NodeStateUpdate`` → the UpcomingNode ``un-<machine>`` (phase from the machine
state; an Idle update on a Draining node means the drain finished: Drained, then
delete). ``AvailableCapacityUpdate`` → ``ac-<16 hex of sha256(supersedes_key)>``.
The shell only compares what these functions want with what is stored and
writes the difference.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any

from bigfleet.needs import ValidationError, format_quantity, parse_quantity
from bigfleet.operator.crds import API_VERSION
from bigfleet.operator.rollup import OPERATOR_NAME
from bigfleet.v1alpha1 import provider_pb2, shard_pb2

_MS = provider_pb2
PHASE_BY_STATE: dict[int, str] = {
    _MS.MACHINE_STATE_SPECULATIVE: "Provisioning",
    _MS.MACHINE_STATE_CREATING: "Provisioning",
    _MS.MACHINE_STATE_IDLE: "Launched",
    _MS.MACHINE_STATE_CONFIGURING: "Registered",
    _MS.MACHINE_STATE_CONFIGURED: "Ready",
    _MS.MACHINE_STATE_DRAINING: "Draining",
    _MS.MACHINE_STATE_FAILED: "Failed",
}
AVAILABILITY = {
    shard_pb2.AvailableCapacityUpdate.CONFIDENCE_LOW: "Low",
    shard_pb2.AvailableCapacityUpdate.CONFIDENCE_MEDIUM: "Medium",
    shard_pb2.AvailableCapacityUpdate.CONFIDENCE_HIGH: "High",
}
_INVALID = re.compile(r"[^a-z0-9.-]+")
_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def dns_subdomain(prefix: str, raw: str) -> str:
    """``prefix + raw`` as a valid DNS-1123 subdomain; a sanitised id gets a hash suffix so ids never collide."""
    clean = _INVALID.sub("-", raw.lower()).strip("-.")
    name = prefix + clean
    if clean != raw or len(name) > 253:
        digest = hashlib.sha256(raw.encode()).hexdigest()[:8]
        name = (prefix + clean)[: 253 - 9].rstrip("-.") + "-" + digest
    return name


def upcoming_name(machine_id: str) -> str:
    return dns_subdomain("un-", machine_id)


def available_capacity_name(supersedes_key: str) -> str:
    return "ac-" + hashlib.sha256(supersedes_key.encode()).hexdigest()[:16]


def canonical_resources(wire: dict[str, str]) -> dict[str, str]:
    """Quantities in canonical form; malformed ones are skipped (the next frame corrects them)."""
    out: dict[str, str] = {}
    for k, v in sorted(wire.items()):
        try:
            out[k] = format_quantity(parse_quantity(v))
        except ValidationError:
            continue
    return out


def upcoming_spec(u: shard_pb2.NodeStateUpdate) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "labels": dict(sorted(u.labels.items())),
        "resources": canonical_resources(dict(u.resources.resources)),
    }
    taints = [
        {"key": t.key, "value": t.value, "effect": t.effect} if t.value else {"key": t.key, "effect": t.effect}
        for t in u.taints
        if t.key and t.effect in _TAINT_EFFECTS
    ]
    if taints:
        spec["taints"] = taints
    return spec


@dataclass(frozen=True)
class UpcomingPlan:
    """What to do with one UpcomingNode: create/patch spec, patch status, delete; None means leave it."""

    name: str
    create: bool
    spec: dict[str, Any] | None  # the spec to write (on create, or when changed)
    status: dict[str, Any] | None  # the status fields to merge-patch (None = unchanged)
    delete: bool
    phase: str


def plan_upcoming(
    u: shard_pb2.NodeStateUpdate, current: dict[str, Any] | None, now_rfc3339: str, *, drained: bool = False,
    node_phase: str | None = None,
) -> UpcomingPlan:
    """``drained``: this machine's UpcomingNode was deleted after a drain here, so a later Idle frame is
    the machine leaving the cluster (not a new one being launched for it) and must not recreate it.

    ``node_phase``: with node registration tracked (``bigfleet.operator.nodes``), the phase of a
    Configured machine as its Node says (Joining / Registered / Ready); the status then also carries
    ``machineID`` and, from the first Configured frame on, ``configuredTime``. None: Configured is
    Ready (the provider's word, for clusters whose machines cannot join: the development stub)."""
    name = upcoming_name(u.machine_id)
    cur_status = (current or {}).get("status") or {}
    cur_phase = cur_status.get("phase")
    phase = PHASE_BY_STATE.get(int(u.state), "Provisioning")
    configured = int(u.state) == _MS.MACHINE_STATE_CONFIGURED
    if configured and node_phase is not None:
        phase = node_phase
    if current is None and drained and int(u.state) == _MS.MACHINE_STATE_IDLE:
        return UpcomingPlan(name, False, None, None, False, "Drained")
    if int(u.state) == _MS.MACHINE_STATE_IDLE and cur_phase in ("Draining", "Drained"):
        # The machine came back to Idle after a drain: this cluster is done with it.
        return UpcomingPlan(name, False, None, {"phase": "Drained"} if cur_phase != "Drained" else None,
                            current is not None, "Drained")
    spec = upcoming_spec(u)
    want: dict[str, Any] = {"phase": phase}
    if u.node_name:
        want["nodeRef"] = {"kind": "Node", "name": u.node_name}
    if u.provider_id:
        want["providerID"] = u.provider_id
    if u.last_error:
        want["lastError"] = u.last_error
    if not cur_status.get("provisioningStartTime"):
        want["provisioningStartTime"] = now_rfc3339
    if node_phase is not None:
        want["machineID"] = u.machine_id
        if configured and not cur_status.get("configuredTime"):
            want["configuredTime"] = now_rfc3339
    status_patch = {k: v for k, v in want.items() if cur_status.get(k) != v}
    if current is None:
        obj_spec: dict[str, Any] | None = spec
        return UpcomingPlan(name, True, obj_spec, status_patch or None, False, phase)
    spec_changed = (current.get("spec") or {}) != spec
    return UpcomingPlan(name, False, spec if spec_changed else None, status_patch or None, False, phase)


def upcoming_object(plan: UpcomingPlan) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "UpcomingNode",
        "metadata": {"name": plan.name, "labels": {"app.kubernetes.io/managed-by": "bigfleet-operator"}},
        "spec": plan.spec or {"resources": {}},
    }


def available_capacity_object(u: shard_pb2.AvailableCapacityUpdate) -> dict[str, Any] | None:
    """The AvailableCapacity CR for ``u``; None when the update has no supersedes key (ignored)."""
    if not u.supersedes_key:
        return None
    reqs = []
    for r in u.requirements:
        op = OPERATOR_NAME.get(r.operator)
        if op is None:
            continue
        item: dict[str, Any] = {"key": r.key, "operator": op}
        if r.values:
            item["values"] = list(r.values)
        reqs.append(item)
    cost = u.cost_per_hour if math.isfinite(u.cost_per_hour) and u.cost_per_hour >= 0 else 0.0
    return {
        "apiVersion": API_VERSION,
        "kind": "AvailableCapacity",
        "metadata": {
            "name": available_capacity_name(u.supersedes_key),
            "labels": {"app.kubernetes.io/managed-by": "bigfleet-operator"},
            "annotations": {"bigfleet.lucy.sh/supersedes-key": u.supersedes_key},
        },
        "spec": {
            "availability": AVAILABILITY.get(u.confidence, "None"),
            "availableCount": max(0, int(u.available_count)),
            "cost": format_quantity(max(0, round(cost * 1000))),
            "requirements": reqs,
            "resources": canonical_resources(dict(u.resources.resources)),
        },
    }
