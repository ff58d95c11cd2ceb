"""The kit's data model: machine records, backend instances, fencing tokens, validation.

Records are plain dataclasses (not protobuf messages) so the pure core can be
driven and compared in tests without a wire in sight; conversion to and from
``provider_pb2.Machine`` lives here too, with a per-record cache of the
serialized bytes because List of a large fleet is dominated by encoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TypeAlias

import grpc

# The kit speaks the same enums as the rest of BigFleet (values are the proto's).
from bigfleet.machine.state import CapacityType as CapacityType
from bigfleet.machine.state import MachineState
from bigfleet.v1alpha1 import provider_pb2

State: TypeAlias = MachineState

STABLE = frozenset({State.SPECULATIVE, State.IDLE, State.CONFIGURED})
TRANSITIONAL = frozenset({State.CREATING, State.CONFIGURING, State.DRAINING, State.DELETING})


class Kind(StrEnum):
    """A lifecycle operation; idempotency is keyed on (machine, kind)."""

    CREATE = "create"
    CONFIGURE = "configure"
    DRAIN = "drain"
    DELETE = "delete"

    @property
    def source(self) -> State:
        return _EDGES[self][0]

    @property
    def transitional(self) -> State:
        return _EDGES[self][1]

    @property
    def target(self) -> State:
        return _EDGES[self][2]


_EDGES: dict[Kind, tuple[State, State, State]] = {
    Kind.CREATE: (State.SPECULATIVE, State.CREATING, State.IDLE),
    Kind.CONFIGURE: (State.IDLE, State.CONFIGURING, State.CONFIGURED),
    Kind.DRAIN: (State.CONFIGURED, State.DRAINING, State.IDLE),
    Kind.DELETE: (State.IDLE, State.DELETING, State.SPECULATIVE),
}

# Identity facts live in top-level fields; duplicating them as labels lets the
# two drift, so the kit refuses records that do it.
FORBIDDEN_LABEL_KEYS = frozenset({
    "instance-type", "instance_type", "instanceType", "zone", "availability-zone",
    "availability_zone", "capacity-type", "capacity_type", "capacityType",
})


TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


@dataclass(frozen=True)
class Taint:
    """A taint the node registers with; forwarded by the shard to the UpcomingNode."""

    key: str
    effect: str
    value: str = ""


class KitError(Exception):
    """An RPC rejection: carries the gRPC status code the contract names."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class InvalidRecord(ValueError):
    """A backend record that breaks the contract (bad price, missing id, ...)."""


@dataclass(frozen=True)
class Fence:
    """The (shard_id, shard_epoch, sequence_number) a mutating RPC carries."""

    shard_id: str = ""
    epoch: int = 0
    sequence: int = 0

    @property
    def is_zero(self) -> bool:
        return self.shard_id == "" and self.epoch == 0 and self.sequence == 0


@dataclass
class HostRef:
    provider: str = ""
    ref: str = ""

    @property
    def empty(self) -> bool:
        return not self.provider and not self.ref


@dataclass
class Instance:
    """What a backend reports about one machine: substrate truth only (no binding)."""

    id: str
    instance_type: str
    zone: str
    capacity_type: CapacityType
    price_per_hour: float = 0.0
    interruption_probability: float = 0.0
    resources: dict[str, str] = field(default_factory=dict)
    allocatable: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    host: HostRef | None = None
    # Only SPECULATIVE (a quota slot) or IDLE (an existing host); None = infer from host.
    state: State | None = None


@dataclass
class MachineRecord:
    """The kit's full view of one machine (substrate truth + binding + bookkeeping).

    Map fields are replaced, never mutated in place, so a snapshot being
    written by a store thread never sees a map change under it.
    """

    id: str
    state: State
    instance_type: str
    zone: str
    capacity_type: CapacityType
    price_per_hour: float = 0.0
    interruption_probability: float = 0.0
    resources: dict[str, str] = field(default_factory=dict)
    allocatable: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[Taint, ...] = ()
    host: HostRef = field(default_factory=HostRef)
    cluster: str = ""
    shard_metadata: dict[str, str] = field(default_factory=dict)
    last_error: str = ""
    # Operation id of the transition in flight (late completions of older ones are dropped).
    op_id: str = ""
    # Revision at which the record last changed; drives incremental List.
    modified: int = 0
    _wire: bytes | None = field(default=None, repr=False, compare=False)
    # Encoding of the fields that rarely change (shape, cost, labels); see wire().
    _static: bytes | None = field(default=None, repr=False, compare=False)
    # wire() framed as one element of MachineList.machines (tag + length + bytes).
    _framed: bytes | None = field(default=None, repr=False, compare=False)

    def touch(self, rev: int, shape_changed: bool = False) -> None:
        self.modified = rev
        self._wire = None
        self._framed = None
        if shape_changed:
            self._static = None

    def copy(self) -> MachineRecord:
        """A snapshot; maps are shared safely because they are only ever replaced, never mutated."""
        return MachineRecord(
            id=self.id, state=self.state, instance_type=self.instance_type, zone=self.zone,
            capacity_type=self.capacity_type, price_per_hour=self.price_per_hour,
            interruption_probability=self.interruption_probability, resources=self.resources,
            allocatable=self.allocatable, labels=self.labels, taints=self.taints,
            host=HostRef(self.host.provider, self.host.ref), cluster=self.cluster,
            shard_metadata=self.shard_metadata, last_error=self.last_error, op_id=self.op_id,
            modified=self.modified, _wire=self._wire, _static=self._static, _framed=self._framed,
        )

    def to_proto(self) -> provider_pb2.Machine:
        m = provider_pb2.Machine(
            id=self.id, state=int(self.state), instance_type=self.instance_type, zone=self.zone,  # type: ignore[arg-type]
            capacity_type=int(self.capacity_type),  # type: ignore[arg-type]
            price_per_hour=self.price_per_hour,
            interruption_probability=self.interruption_probability, labels=self.labels,
            last_error=self.last_error, cluster=self.cluster, shard_metadata=self.shard_metadata,
            taints=_taints_pb(self.taints),
        )
        if not self.host.empty:
            m.host.provider = self.host.provider
            m.host.ref = self.host.ref
        if self.resources:
            m.resources.resources.update(self.resources)
        if self.allocatable:
            m.allocatable.resources.update(self.allocatable)
        return m

    def framed(self) -> bytes:
        if self._framed is None:
            w = self.wire()
            self._framed = b"\x0a" + _varint(len(w)) + w
        return self._framed

    def wire(self) -> bytes:
        """Serialized ``Machine`` bytes, cached until the record changes.

        Protobuf fields may appear in any order, so the encoding is the cached
        bytes of the rarely-changing fields followed by a small hand-encoded
        part for the fields every transition touches (id, state, host,
        last_error, cluster, shard_metadata).
        """
        if self._wire is None:
            if self._static is None:
                m = provider_pb2.Machine(
                    instance_type=self.instance_type, zone=self.zone,
                    capacity_type=int(self.capacity_type),  # type: ignore[arg-type]
                    price_per_hour=self.price_per_hour, interruption_probability=self.interruption_probability,
                    labels=self.labels, taints=_taints_pb(self.taints),
                )
                if self.resources:
                    m.resources.resources.update(self.resources)
                if self.allocatable:
                    m.allocatable.resources.update(self.allocatable)
                self._static = m.SerializeToString(deterministic=True)
            parts = [self._static, _str_field(0x0A, self.id)]
            if self.state:
                parts.append(b"\x10" + _varint(int(self.state)))
            if not self.host.empty:
                parts.append(_bytes_field(0x1A, _str_field(0x0A, self.host.provider) + _str_field(0x12, self.host.ref)))
            parts.append(_str_field(0x62, self.last_error))
            parts.append(_str_field(0x72, self.cluster))
            for k in sorted(self.shard_metadata):
                entry = _bytes_field(0x0A, k.encode()) + _bytes_field(0x12, self.shard_metadata[k].encode())
                parts.append(_bytes_field(0x7A, entry))
            self._wire = b"".join(parts)
        return self._wire

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id, "state": self.state.name, "instance_type": self.instance_type, "zone": self.zone,
            "capacity_type": self.capacity_type.name, "price_per_hour": self.price_per_hour,
            "interruption_probability": self.interruption_probability, "resources": self.resources,
            "allocatable": self.allocatable, "labels": self.labels,
            **({"taints": [{"key": t.key, "value": t.value, "effect": t.effect} for t in self.taints]}
               if self.taints else {}),
            "host": {"provider": self.host.provider, "ref": self.host.ref}, "cluster": self.cluster,
            "shard_metadata": self.shard_metadata, "last_error": self.last_error, "op_id": self.op_id,
        }

    @classmethod
    def from_json(cls, d: dict[str, object]) -> MachineRecord:
        host = d.get("host") or {}
        assert isinstance(host, dict)
        return cls(
            id=str(d["id"]), state=MachineState[str(d["state"])], instance_type=str(d["instance_type"]),
            zone=str(d.get("zone", "")), capacity_type=CapacityType[str(d["capacity_type"])],
            price_per_hour=float(d.get("price_per_hour", 0.0)),  # type: ignore[arg-type]
            interruption_probability=float(d.get("interruption_probability", 0.0)),  # type: ignore[arg-type]
            resources=_str_map(d.get("resources")), allocatable=_str_map(d.get("allocatable")),
            labels=_str_map(d.get("labels")), host=HostRef(str(host.get("provider", "")), str(host.get("ref", ""))),
            cluster=str(d.get("cluster", "")), shard_metadata=_str_map(d.get("shard_metadata")),
            last_error=str(d.get("last_error", "")), op_id=str(d.get("op_id", "")),
            taints=_taints_json(d.get("taints")),
        )


def _taints_pb(taints: tuple[Taint, ...]) -> list[provider_pb2.NodeTaint]:
    return [provider_pb2.NodeTaint(key=t.key, value=t.value, effect=t.effect) for t in taints]


def _taints_json(v: object) -> tuple[Taint, ...]:
    if not v:
        return ()
    if not isinstance(v, list):
        raise ValueError(f"expected a list of taints, got {type(v).__name__}")
    return tuple(Taint(str(t["key"]), str(t["effect"]), str(t.get("value", ""))) for t in v)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _bytes_field(tag: int, payload: bytes) -> bytes:
    return bytes((tag,)) + _varint(len(payload)) + payload


def _str_field(tag: int, value: str) -> bytes:
    """A proto3 string field; the empty string is the default and is omitted."""
    return _bytes_field(tag, value.encode()) if value else b""


def _str_map(v: object) -> dict[str, str]:
    if not v:
        return {}
    if not isinstance(v, dict):
        raise ValueError(f"expected a map, got {type(v).__name__}")
    return {str(k): str(x) for k, x in v.items()}


def _valid_quantity(q: str) -> bool:
    """A loose Kubernetes quantity check: a number with an optional SI/binary suffix."""
    import re

    return bool(re.fullmatch(r"[+]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[kMGTPE]i?|[mun])?", q))


def validate_instance(inst: Instance, require_zone: bool = False) -> State:
    """Check one backend record; returns its resting state (SPECULATIVE or IDLE)."""
    if not inst.id:
        raise InvalidRecord("instance has an empty id")
    where = f"instance {inst.id!r}"
    if not inst.instance_type:
        raise InvalidRecord(f"{where}: empty instance_type")
    if inst.capacity_type not in CapacityType or inst.capacity_type == CapacityType.UNSPECIFIED:
        raise InvalidRecord(f"{where}: capacity_type must be set")
    if require_zone and not inst.zone:
        raise InvalidRecord(f"{where}: empty zone")
    p = inst.price_per_hour
    if not isinstance(p, (int, float)) or not math.isfinite(p) or p < 0:
        raise InvalidRecord(f"{where}: price_per_hour must be finite and >= 0, got {p!r}")
    q = inst.interruption_probability
    if not isinstance(q, (int, float)) or not math.isfinite(q) or not 0.0 <= q <= 1.0:
        raise InvalidRecord(f"{where}: interruption_probability must be in [0, 1], got {q!r}")
    if inst.capacity_type == CapacityType.SPOT and q <= 0:
        raise InvalidRecord(f"{where}: a SPOT machine needs interruption_probability > 0")
    bad = FORBIDDEN_LABEL_KEYS.intersection(inst.labels)
    if bad:
        raise InvalidRecord(f"{where}: labels duplicate top-level fields: {sorted(bad)}")
    for t in inst.taints:
        if not t.key or t.effect not in TAINT_EFFECTS:
            raise InvalidRecord(f"{where}: taint {t!r} needs a key and an effect in {TAINT_EFFECTS}")
    for name, qty in (*inst.resources.items(), *inst.allocatable.items()):
        if not _valid_quantity(qty):
            raise InvalidRecord(f"{where}: resource {name}={qty!r} is not a quantity")
    has_host = inst.host is not None and not inst.host.empty
    state = inst.state if inst.state is not None else (State.IDLE if has_host else State.SPECULATIVE)
    if state == State.SPECULATIVE and has_host:
        raise InvalidRecord(f"{where}: a SPECULATIVE slot cannot have a host")
    if state == State.IDLE and not has_host:
        raise InvalidRecord(f"{where}: an IDLE machine needs a host")
    if state not in (State.SPECULATIVE, State.IDLE):
        raise InvalidRecord(f"{where}: a backend may only report SPECULATIVE or IDLE, not {state.name}")
    return state


def record_from_instance(inst: Instance, state: State) -> MachineRecord:
    host = inst.host if inst.host is not None else HostRef()
    return MachineRecord(
        id=inst.id, state=state, instance_type=inst.instance_type, zone=inst.zone,
        capacity_type=CapacityType(inst.capacity_type), price_per_hour=float(inst.price_per_hour),
        interruption_probability=float(inst.interruption_probability), resources=dict(inst.resources),
        allocatable=dict(inst.allocatable), labels=dict(inst.labels), host=HostRef(host.provider, host.ref),
        taints=tuple(inst.taints),
    )
