"""Pydantic models of the three BigFleet custom resources (group ``bigfleet.lucy.sh``, ``v1alpha1``).

They validate what the API server hands us (it does not know our schema in
tests, and a real one validates only the OpenAPI shape), so every object the
operator acts on has passed one place that knows the rules. CRs stay dicts on
the wire; these models are parsed from them and dumped back with aliases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

GROUP = "bigfleet.lucy.sh"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
CAPACITY_REQUESTS = "capacityrequests"
AVAILABLE_CAPACITIES = "availablecapacities"
UPCOMING_NODES = "upcomingnodes"

CRD_DIR = Path(__file__).resolve().parents[3] / "deploy" / "crds"

#: A CapacityRequest annotated ``bigfleet.lucy.sh/dry-run: "true"`` is never rolled up: the operator asks
#: the shard what would happen (ShardRead.WhatIf) and writes the answer to ``status.whatIf`` instead.
DRY_RUN_ANNOTATION = f"{GROUP}/dry-run"


def is_dry_run(obj: dict[str, Any]) -> bool:
    """Whether a CapacityRequest (as an API dict) carries the dry-run marker."""
    ann = (obj.get("metadata") or {}).get("annotations") or {}
    return str(ann.get(DRY_RUN_ANNOTATION, "")).strip().lower() == "true"

CORE_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
Quantity = int | float | str


class _Model(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)


class RequirementSpec(_Model):
    key: str = Field(min_length=1)
    operator: str
    values: tuple[str, ...] = ()


class TopologySpreadSpec(_Model):
    max_skew: int = Field(alias="maxSkew", ge=1)
    topology_key: str = Field(alias="topologyKey", min_length=1)
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(alias="whenUnsatisfiable")


class LabelSelectorRequirementSpec(_Model):
    key: str
    operator: str
    values: tuple[str, ...] = ()


class LabelSelectorSpec(_Model):
    match_labels: dict[str, str] = Field(default_factory=dict, alias="matchLabels")
    match_expressions: tuple[LabelSelectorRequirementSpec, ...] = Field(default=(), alias="matchExpressions")


class CoLocationSpec(_Model):
    topology_key: str = Field(alias="topologyKey")
    label_selector: LabelSelectorSpec | None = Field(default=None, alias="labelSelector")


def _quantity_str(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise ValueError(f"expected a quantity, got {type(v).__name__}")
    return str(v)


class CapacityRequestSpec(_Model):
    priority: int = Field(ge=-(2**31), le=2**31 - 1)
    resources: dict[str, str]
    requirements: tuple[RequirementSpec, ...] = ()
    interruption_penalty: str | None = Field(default=None, alias="interruptionPenalty")
    reclamation_penalty: str | None = Field(default=None, alias="reclamationPenalty")
    topology_spread: tuple[TopologySpreadSpec, ...] = Field(default=(), alias="topologySpread")
    co_location: CoLocationSpec | None = Field(default=None, alias="coLocation")

    @field_validator("resources", mode="before")
    @classmethod
    def _resources(cls, v: Any) -> dict[str, str]:
        if not isinstance(v, dict):
            raise ValueError("resources must be a map of name -> quantity")
        return {str(k): _quantity_str(q) for k, q in v.items()}

    @field_validator("interruption_penalty", "reclamation_penalty", mode="before")
    @classmethod
    def _penalty(cls, v: Any) -> str | None:
        return None if v is None else _quantity_str(v)


class CapacityRequestStatus(_Model):
    phase: Literal["", "Pending", "Acknowledged"] = ""
    acknowledged_at: str | None = Field(default=None, alias="acknowledgedAt")


class ObjectMeta(_Model):
    name: str
    namespace: str = ""
    uid: str = ""
    resource_version: str = Field(default="", alias="resourceVersion")
    labels: dict[str, str] = Field(default_factory=dict)


class CapacityRequest(_Model):
    metadata: ObjectMeta
    spec: CapacityRequestSpec
    status: CapacityRequestStatus = CapacityRequestStatus()

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> CapacityRequest:
        return cls.model_validate({**obj, "status": obj.get("status") or {}})


AvailabilityName = Literal["None", "Low", "Medium", "High"]


class AvailableCapacitySpec(_Model):
    availability: AvailabilityName
    available_count: int = Field(alias="availableCount", ge=0)
    cost: str
    requirements: tuple[RequirementSpec, ...] = ()
    resources: dict[str, str] = Field(default_factory=dict)


UpcomingPhase = Literal["Provisioning", "Launched", "Registered", "Joining", "Ready", "Draining", "Drained", "Failed"]


class TaintSpec(_Model):
    key: str
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]
    value: str = ""


class UpcomingNodeSpec(_Model):
    labels: dict[str, str] = Field(default_factory=dict)
    resources: dict[str, str] = Field(default_factory=dict)
    taints: tuple[TaintSpec, ...] = ()


class NodeRef(_Model):
    kind: str = "Node"
    name: str


class UpcomingNodeStatus(_Model):
    phase: UpcomingPhase
    node_ref: NodeRef | None = Field(default=None, alias="nodeRef")
    provider_id: str | None = Field(default=None, alias="providerID")
    provisioning_start_time: str | None = Field(default=None, alias="provisioningStartTime")
    last_error: str | None = Field(default=None, alias="lastError")
    machine_id: str | None = Field(default=None, alias="machineID")
    configured_time: str | None = Field(default=None, alias="configuredTime")
    drain_deadline: str | None = Field(default=None, alias="drainDeadline")


def dump(model: BaseModel) -> dict[str, Any]:
    """The wire (camelCase) form of a model, without unset optionals."""
    return model.model_dump(by_alias=True, exclude_none=True, mode="json")


def crd_manifests(directory: Path | None = None) -> list[dict[str, Any]]:
    """The CRD manifests shipped in ``deploy/crds`` (installed by Helm or ``kubectl apply -f``)."""
    d = directory or CRD_DIR
    return [yaml.safe_load(p.read_text()) for p in sorted(d.glob("*.yaml"))]
