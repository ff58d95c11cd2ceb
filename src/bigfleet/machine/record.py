"""`Machine`: a compact, immutable record of one machine (or speculative slot).

Everything that is the same for every machine of a type (instance type, zone, capacity type, price,
interruption probability, labels, resources) lives in one shared `MachineShape`; everything stamped
by an assignment (priority, penalties, need fingerprint, group) lives in one shared `Assignment`.
A record is then ten pointers, which is what lets a shard hold 500 000 of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from bigfleet.machine.labels import DEFAULT_INTERNER, EMPTY_LABELS, Interner, Labels
from bigfleet.machine.state import CapacityType, MachineState
from bigfleet.needs.requirements import Requirement
from bigfleet.needs.resources import EMPTY, Resources

_setattr = object.__setattr__

INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
ZONE_LABEL = "topology.kubernetes.io/zone"


class MachineShape:
    """The per-type part of a machine, shared between every machine with equal values."""

    __slots__ = (
        "_hash",
        "allocatable",
        "capacity_type",
        "instance_type",
        "interruption_probability",
        "labels",
        "match_labels",
        "price_per_hour",
        "resources",
        "zone",
    )

    instance_type: str
    zone: str
    capacity_type: CapacityType
    price_per_hour: float
    interruption_probability: float
    labels: Labels
    resources: Resources
    allocatable: Resources
    match_labels: Labels
    _hash: int

    def __init__(
        self,
        instance_type: str = "",
        zone: str = "",
        capacity_type: CapacityType = CapacityType.UNSPECIFIED,
        price_per_hour: float = 0.0,
        interruption_probability: float = 0.0,
        labels: Labels = EMPTY_LABELS,
        resources: Resources = EMPTY,
        allocatable: Resources = EMPTY,
    ) -> None:
        _setattr(self, "instance_type", instance_type)
        _setattr(self, "zone", zone)
        _setattr(self, "capacity_type", CapacityType(capacity_type))
        _setattr(self, "price_per_hour", float(price_per_hour))
        _setattr(self, "interruption_probability", float(interruption_probability))
        _setattr(self, "labels", labels)
        _setattr(self, "resources", resources)
        _setattr(self, "allocatable", allocatable)
        # What requirements are matched against: instance type and zone fields win over labels.
        extra = {}
        if instance_type:
            extra[INSTANCE_TYPE_LABEL] = instance_type
        if zone:
            extra[ZONE_LABEL] = zone
        _setattr(self, "match_labels", labels.with_items(extra) if extra else labels)
        _setattr(self, "_hash", hash(self._key()))

    def _key(self) -> tuple[Any, ...]:
        return (
            self.instance_type,
            self.zone,
            int(self.capacity_type),
            self.price_per_hour,
            self.interruption_probability,
            self.labels,
            self.resources,
            self.allocatable,
        )

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, MachineShape):
            return NotImplemented
        return self._hash == other._hash and self._key() == other._key()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("MachineShape is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (MachineShape, self._key())

    def __repr__(self) -> str:
        return (
            f"MachineShape({self.instance_type!r}, {self.zone!r}, {self.capacity_type.name}, "
            f"${self.price_per_hour}/h, p={self.interruption_probability})"
        )


class Assignment:
    """What a Configure stamped on a machine (echoed back through shard_metadata after restarts)."""

    __slots__ = (
        "_hash",
        "group",
        "interruption_penalty_dollars",
        "need_fingerprint",
        "priority",
        "reclamation_penalty_dollars",
    )

    priority: int
    interruption_penalty_dollars: float
    reclamation_penalty_dollars: float
    need_fingerprint: str
    group: str
    _hash: int

    def __init__(
        self,
        priority: int = 0,
        interruption_penalty_dollars: float = 0.0,
        reclamation_penalty_dollars: float = 0.0,
        need_fingerprint: str = "",
        group: str = "",
    ) -> None:
        _setattr(self, "priority", int(priority))
        _setattr(self, "interruption_penalty_dollars", float(interruption_penalty_dollars))
        _setattr(self, "reclamation_penalty_dollars", float(reclamation_penalty_dollars))
        _setattr(self, "need_fingerprint", need_fingerprint)
        _setattr(self, "group", group)
        _setattr(self, "_hash", hash(self._key()))

    def _key(self) -> tuple[int, float, float, str, str]:
        return (
            self.priority,
            self.interruption_penalty_dollars,
            self.reclamation_penalty_dollars,
            self.need_fingerprint,
            self.group,
        )

    @property
    def is_empty(self) -> bool:
        return self._key() == _EMPTY_KEY

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Assignment):
            return NotImplemented
        return self._key() == other._key()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Assignment is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (Assignment, self._key())

    def __repr__(self) -> str:
        return "Assignment(priority={}, ipd={}, rpd={}, fp={!r}, group={!r})".format(*self._key())


_EMPTY_KEY = (0, 0.0, 0.0, "", "")
NO_ASSIGNMENT = Assignment()


class Machine:
    """One machine. Immutable: change it with `replace()` (or through `Inventory`).

    Flat keyword construction interns the shared parts automatically, so callers never deal with
    `MachineShape`/`Assignment` unless they want to.
    """

    __slots__ = (
        "assignment",
        "cluster",
        "host_provider",
        "host_ref",
        "id",
        "last_error",
        "node_name",
        "shape",
        "state",
        "state_since_unix_nanos",
    )

    id: str
    state: MachineState
    shape: MachineShape
    cluster: str
    host_provider: str
    host_ref: str
    node_name: str
    last_error: str
    assignment: Assignment
    state_since_unix_nanos: int

    def __init__(
        self,
        id: str,
        state: MachineState,
        *,
        instance_type: str = "",
        zone: str = "",
        capacity_type: CapacityType = CapacityType.UNSPECIFIED,
        price_per_hour: float = 0.0,
        interruption_probability: float = 0.0,
        labels: Mapping[str, str] | None = None,
        resources: Resources = EMPTY,
        allocatable: Resources = EMPTY,
        cluster: str = "",
        host_provider: str = "",
        host_ref: str = "",
        node_name: str = "",
        last_error: str = "",
        assigned_priority: int = 0,
        assigned_interruption_penalty_dollars: float = 0.0,
        assigned_reclamation_penalty_dollars: float = 0.0,
        assigned_need_fingerprint: str = "",
        assigned_group: str = "",
        state_since_unix_nanos: int = 0,
        shape: MachineShape | None = None,
        assignment: Assignment | None = None,
        interner: Interner | None = None,
    ) -> None:
        it = interner or DEFAULT_INTERNER
        if shape is None:
            # Look the shape up by its raw inputs first: building and hashing a MachineShape (and
            # sorting labels) is the expensive part, and nearly every machine repeats an existing one.
            lkey: object = labels if (labels is None or type(labels) is Labels) else tuple(labels.items())
            raw = (instance_type, zone, int(capacity_type), price_per_hour, interruption_probability, lkey,
                   resources, allocatable)
            shape = it.lookup("shape-raw", raw)
            if shape is None:
                shape = it.intern("shape", MachineShape(
                    it.string(instance_type),
                    it.string(zone),
                    CapacityType(capacity_type),
                    it.intern("float", float(price_per_hour)),
                    it.intern("float", float(interruption_probability)),
                    it.labels(labels),
                    it.intern("resources", resources),
                    it.intern("resources", allocatable),
                ))
                it.remember("shape-raw", raw, shape)
        else:
            shape = it.intern("shape", shape)
        if assignment is None:
            akey = (assigned_priority, assigned_interruption_penalty_dollars, assigned_reclamation_penalty_dollars,
                    assigned_need_fingerprint, assigned_group)
            if akey == _EMPTY_KEY:
                assignment = NO_ASSIGNMENT
            else:
                assignment = it.lookup("assignment-raw", akey)
                if assignment is None:
                    assignment = it.intern("assignment", Assignment(
                        assigned_priority,
                        assigned_interruption_penalty_dollars,
                        assigned_reclamation_penalty_dollars,
                        it.string(assigned_need_fingerprint),
                        it.string(assigned_group),
                    ))
                    it.remember("assignment-raw", akey, assignment)
        else:
            assignment = NO_ASSIGNMENT if assignment.is_empty else it.intern("assignment", assignment)
        _setattr(self, "id", id)
        _setattr(self, "state", state if type(state) is MachineState else MachineState(state))
        _setattr(self, "shape", shape)
        _setattr(self, "cluster", it.string(cluster))
        _setattr(self, "host_provider", it.string(host_provider))
        _setattr(self, "host_ref", host_ref)
        _setattr(self, "node_name", node_name)
        _setattr(self, "last_error", last_error)
        _setattr(self, "assignment", assignment)
        _setattr(self, "state_since_unix_nanos", int(state_since_unix_nanos))

    # --- copying -----------------------------------------------------------------------------

    def replace(self, **changes: Any) -> Machine:
        """A copy with `changes` applied. Direct slots (state, cluster, ...) are cheap; changing a
        shape field (``price_per_hour``...) or an ``assigned_*`` field rebuilds and re-interns that part.
        """
        new = object.__new__(Machine)
        pop = changes.pop
        _setattr(new, "assignment", pop("assignment", self.assignment))
        _setattr(new, "cluster", pop("cluster", self.cluster))
        _setattr(new, "host_provider", pop("host_provider", self.host_provider))
        _setattr(new, "host_ref", pop("host_ref", self.host_ref))
        _setattr(new, "id", pop("id", self.id))
        _setattr(new, "last_error", pop("last_error", self.last_error))
        _setattr(new, "node_name", pop("node_name", self.node_name))
        _setattr(new, "shape", pop("shape", self.shape))
        state = pop("state", self.state)
        _setattr(new, "state", state if type(state) is MachineState else MachineState(state))
        _setattr(new, "state_since_unix_nanos", pop("state_since_unix_nanos", self.state_since_unix_nanos))
        if changes:
            interner = changes.pop("interner", None) or DEFAULT_INTERNER
            shape_changes = {k: changes.pop(k) for k in list(changes) if k in _SHAPE_FIELDS}
            assign_changes = {k: changes.pop(k) for k in list(changes) if k in _ASSIGNED_FIELDS}
            if changes:
                raise TypeError(f"unknown Machine fields: {sorted(changes)}")
            if shape_changes:
                s = new.shape
                kw: dict[str, Any] = {f: getattr(s, f) for f in _SHAPE_FIELDS}
                kw.update(shape_changes)
                kw["labels"] = interner.labels(kw["labels"])
                kw["resources"] = interner.intern("resources", kw["resources"])
                kw["allocatable"] = interner.intern("resources", kw["allocatable"])
                _setattr(new, "shape", interner.intern("shape", MachineShape(**kw)))
            if assign_changes:
                a = new.assignment
                akw: dict[str, Any] = {f[len("assigned_"):]: getattr(a, f[len("assigned_"):]) for f in _ASSIGNED_FIELDS}
                akw.update({k[len("assigned_"):]: v for k, v in assign_changes.items()})
                na = Assignment(**akw)
                _setattr(new, "assignment", NO_ASSIGNMENT if na.is_empty else interner.intern("assignment", na))
        return new

    def unassigned(self, state: MachineState | None = None, now_unix_nanos: int | None = None) -> Machine:
        """A copy with the cluster binding and every ``assigned_*`` field cleared (drain completion)."""
        changes: dict[str, Any] = {"cluster": "", "assignment": NO_ASSIGNMENT}
        if state is not None:
            changes["state"] = state
        if now_unix_nanos is not None:
            changes["state_since_unix_nanos"] = now_unix_nanos
        return self.replace(**changes)

    # --- shape accessors -----------------------------------------------------------------------

    @property
    def instance_type(self) -> str:
        return self.shape.instance_type

    @property
    def zone(self) -> str:
        return self.shape.zone

    @property
    def capacity_type(self) -> CapacityType:
        return self.shape.capacity_type

    @property
    def price_per_hour(self) -> float:
        return self.shape.price_per_hour

    @property
    def interruption_probability(self) -> float:
        return self.shape.interruption_probability

    @property
    def labels(self) -> Labels:
        return self.shape.labels

    @property
    def match_labels(self) -> Labels:
        """Labels plus instance type and zone: what requirements are matched against."""
        return self.shape.match_labels

    @property
    def resources(self) -> Resources:
        return self.shape.resources

    @property
    def allocatable(self) -> Resources:
        return self.shape.allocatable

    @property
    def effective_allocatable(self) -> Resources:
        """Allocatable when the provider reported it, else the per-replica resources."""
        s = self.shape
        return s.allocatable if s.allocatable._items else s.resources

    # --- assignment accessors ------------------------------------------------------------------

    @property
    def assigned_priority(self) -> int:
        return self.assignment.priority

    @property
    def assigned_interruption_penalty_dollars(self) -> float:
        return self.assignment.interruption_penalty_dollars

    @property
    def assigned_reclamation_penalty_dollars(self) -> float:
        return self.assignment.reclamation_penalty_dollars

    reclamation_penalty_dollars = assigned_reclamation_penalty_dollars

    @property
    def assigned_need_fingerprint(self) -> str:
        return self.assignment.need_fingerprint

    @property
    def assigned_group(self) -> str:
        return self.assignment.group

    # --- derived -------------------------------------------------------------------------------

    @property
    def has_host(self) -> bool:
        return bool(self.host_provider or self.host_ref)

    @property
    def is_stable(self) -> bool:
        return self.state.is_stable

    @property
    def reclaim_name(self) -> str:
        """What a ReclaimInstruction names: the node name, or the machine id when none is known."""
        return self.node_name or self.id

    def effective_cost(self, interruption_penalty_dollars: float) -> float:
        """``price + interruption_probability × max(0, penalty)``; never NaN (a pinned penalty with
        zero probability costs just the price; with any probability it is infinite)."""
        s = self.shape
        p = s.interruption_probability
        if p <= 0.0 or not interruption_penalty_dollars > 0.0:
            return s.price_per_hour
        return s.price_per_hour + p * interruption_penalty_dollars

    def matches(self, requirements: Iterable[Requirement]) -> bool:
        """Whether every requirement in `requirements` passes against `match_labels`."""
        ml = self.shape.match_labels
        return all(r.matches(ml) for r in requirements)

    # --- identity ------------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Machine):
            return NotImplemented
        return all(getattr(self, n) == getattr(other, n) for n in Machine.__slots__)

    def __hash__(self) -> int:
        return hash(self.id)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Machine is immutable; use replace()")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore_machine, (tuple(getattr(self, n) for n in Machine.__slots__),))

    def __repr__(self) -> str:
        extra = f", cluster={self.cluster!r}" if self.cluster else ""
        return f"Machine({self.id!r}, {self.state.name}, {self.shape.instance_type!r}{extra})"


def _restore_machine(values: tuple[Any, ...]) -> Machine:
    m = object.__new__(Machine)
    for name, v in zip(Machine.__slots__, values, strict=True):
        _setattr(m, name, v)
    return m


_SHAPE_FIELDS = (
    "instance_type",
    "zone",
    "capacity_type",
    "price_per_hour",
    "interruption_probability",
    "labels",
    "resources",
    "allocatable",
)
_ASSIGNED_FIELDS = (
    "assigned_priority",
    "assigned_interruption_penalty_dollars",
    "assigned_reclamation_penalty_dollars",
    "assigned_need_fingerprint",
    "assigned_group",
)


def effective_cost(price_per_hour: float, interruption_probability: float, penalty_dollars: float) -> float:
    """The effective-cost formula on plain numbers (NaN-free, see `Machine.effective_cost`)."""
    if interruption_probability <= 0.0 or not penalty_dollars > 0.0:
        return price_per_hour
    return price_per_hour + interruption_probability * penalty_dollars
