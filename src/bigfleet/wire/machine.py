"""Conversions between the provider `Machine` proto and `Machine`, and the shard_metadata keys.

`shard_metadata` is the only durable copy of what a shard stamped at Configure time: the provider
stores and echoes it verbatim, and a restarted shard decodes it to restore priorities and penalties.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from bigfleet.machine.labels import DEFAULT_INTERNER, Interner, Labels
from bigfleet.machine.record import NO_ASSIGNMENT, Assignment, Machine, MachineShape
from bigfleet.machine.state import CapacityType, MachineState
from bigfleet.machine.validate import check_cost_fields, check_invariant
from bigfleet.needs.errors import ValidationError
from bigfleet.needs.requirements import MAX_LABEL_KEY_LEN, MAX_LABEL_VALUE_LEN
from bigfleet.needs.resources import Resources
from bigfleet.v1alpha1 import provider_pb2

META_PREFIX = "bigfleet.lucy.sh/"
META_ASSIGNED_PRIORITY = META_PREFIX + "assigned-priority"
META_INTERRUPTION_PENALTY = META_PREFIX + "assigned-interruption-penalty-dollars"
META_RECLAMATION_PENALTY = META_PREFIX + "assigned-reclamation-penalty-dollars"
META_NEED_FINGERPRINT = META_PREFIX + "assigned-need-fingerprint"
META_GROUP = META_PREFIX + "assigned-group"
#: The Kubernetes node name the shard learned (from the operator) for a machine, stored so it survives
#: restarts when the provider does not report a hostname label.
META_NODE_NAME = META_PREFIX + "node-name"
#: Provider label carrying the node name (preferred over the metadata copy).
HOSTNAME_LABEL = "kubernetes.io/hostname"
WELL_KNOWN_METADATA_KEYS = (
    META_ASSIGNED_PRIORITY,
    META_INTERRUPTION_PENALTY,
    META_RECLAMATION_PENALTY,
    META_NEED_FINGERPRINT,
    META_GROUP,
)

MAX_LABELS = 256
MAX_TEXT_LEN = 253
MAX_FINGERPRINT_LEN = 128
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1


# --- Go-compatible float formatting ------------------------------------------------------------


def format_go_float(x: float) -> str:
    """`x` formatted like Go's ``strconv.FormatFloat(x, 'g', -1, 64)`` (``%g`` shortest).

    Shortest round-trip digits; exponent form when the decimal exponent is < -4 or >= 6 (Go's rule
    for shortest ``%g``), so 8388608 is ``8.388608e+06`` and 524288 stays ``524288``.
    """
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if x == 0:
        return "-0" if math.copysign(1.0, x) < 0 else "0"
    sign = "-" if x < 0 else ""
    digits, exp = _shortest_digits(abs(x))  # value = 0.d1d2... × 10**exp
    e = exp - 1  # exponent in d1.d2d3 form
    if e < -4 or e >= 6:
        mant = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        return f"{sign}{mant}e{'-' if e < 0 else '+'}{abs(e):02d}"
    if exp <= 0:
        return f"{sign}0.{'0' * -exp}{digits}"
    if exp >= len(digits):
        return f"{sign}{digits}{'0' * (exp - len(digits))}"
    return f"{sign}{digits[:exp]}.{digits[exp:]}"


def _shortest_digits(x: float) -> tuple[str, int]:
    """Shortest round-trip decimal digits of positive finite `x` and the exponent `exp` with x = 0.digits × 10**exp."""
    r = repr(x)
    mant, _, e_part = r.partition("e")
    exp10 = int(e_part) if e_part else 0
    int_part, _, frac = mant.partition(".")
    if frac == "0":
        frac = ""
    digits = (int_part + frac).lstrip("0")
    lead_zeros = len(int_part + frac) - len((int_part + frac).lstrip("0"))
    exp = len(int_part) - lead_zeros + exp10
    digits = digits.rstrip("0") or "0"
    return digits, exp


def parse_go_float(s: str) -> float:
    """Parse a Go ``%g`` float (also ``+Inf``/``Inf``); ``ValueError`` on anything else or NaN."""
    t = s.strip()
    low = t.lower()
    if low in ("+inf", "inf", "+infinity", "infinity"):
        return math.inf
    if low in ("-inf", "-infinity"):
        return -math.inf
    if not t or any(c not in "0123456789+-.eE" for c in t):
        raise ValueError(f"not a float: {s!r}")
    return float(t)


# --- shard_metadata ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodedMetadata:
    """Well-known shard_metadata values; None where the key was absent or its value malformed."""

    priority: int | None = None
    interruption_penalty_dollars: float | None = None
    reclamation_penalty_dollars: float | None = None
    need_fingerprint: str | None = None
    group: str | None = None
    malformed: tuple[str, ...] = ()

    def apply_to(self, base: Assignment) -> Assignment:
        """`base` with every decoded value laid over it (absent keys leave `base` untouched)."""
        return Assignment(
            base.priority if self.priority is None else self.priority,
            base.interruption_penalty_dollars
            if self.interruption_penalty_dollars is None
            else self.interruption_penalty_dollars,
            base.reclamation_penalty_dollars
            if self.reclamation_penalty_dollars is None
            else self.reclamation_penalty_dollars,
            base.need_fingerprint if self.need_fingerprint is None else self.need_fingerprint,
            base.group if self.group is None else self.group,
        )


def encode_shard_metadata(a: Assignment) -> dict[str, str]:
    """The well-known keys for an assignment (what the shard puts in `ConfigureRequest.shard_metadata`)."""
    md = {
        META_ASSIGNED_PRIORITY: str(a.priority),
        META_INTERRUPTION_PENALTY: format_go_float(a.interruption_penalty_dollars),
        META_RECLAMATION_PENALTY: format_go_float(a.reclamation_penalty_dollars),
    }
    if a.need_fingerprint:
        md[META_NEED_FINGERPRINT] = a.need_fingerprint
    if a.group:
        md[META_GROUP] = a.group
    return md


def decode_shard_metadata(md: Mapping[str, str]) -> DecodedMetadata:
    """Decode each well-known key on its own; a malformed value is skipped (and listed), never fatal."""
    bad: list[str] = []
    prio: int | None = None
    raw = md.get(META_ASSIGNED_PRIORITY)
    if raw is not None:
        try:
            v = int(raw.strip(), 10)
            if not _INT32_MIN <= v <= _INT32_MAX:
                raise ValueError("out of int32 range")
            prio = v
        except ValueError:
            bad.append(META_ASSIGNED_PRIORITY)
    pens: list[float | None] = []
    for key in (META_INTERRUPTION_PENALTY, META_RECLAMATION_PENALTY):
        raw = md.get(key)
        val: float | None = None
        if raw is not None:
            try:
                f = parse_go_float(raw)
                if f < 0:
                    raise ValueError("negative")
                val = f
            except ValueError:
                bad.append(key)
        pens.append(val)
    fp = md.get(META_NEED_FINGERPRINT)
    if fp is not None and (len(fp) > MAX_FINGERPRINT_LEN or not fp.isprintable()):
        bad.append(META_NEED_FINGERPRINT)
        fp = None
    group = md.get(META_GROUP)
    if group is not None and (len(group) > MAX_TEXT_LEN or not group.isprintable()):
        bad.append(META_GROUP)
        group = None
    return DecodedMetadata(prio, pens[0], pens[1], fp, group, tuple(bad))


# --- Machine ↔ proto ---------------------------------------------------------------------------


def _labels(pb_labels: Mapping[str, str], field: str) -> dict[str, str]:
    if len(pb_labels) > MAX_LABELS:
        raise ValidationError(field, f"more than {MAX_LABELS} labels")
    for k, v in pb_labels.items():
        if not k or len(k) > MAX_LABEL_KEY_LEN or not k.isprintable() or any(c.isspace() for c in k):
            raise ValidationError(f'{field}["{k}"]', "bad label key")
        if len(v) > MAX_LABEL_VALUE_LEN or not v.isprintable():
            raise ValidationError(f'{field}["{k}"]', f"label value longer than {MAX_LABEL_VALUE_LEN} characters or not printable")
    return dict(pb_labels)


def _text(value: str, field: str, max_len: int = MAX_TEXT_LEN) -> str:
    if len(value) > max_len:
        raise ValidationError(field, f"longer than {max_len} characters")
    if value and not value.isprintable():
        raise ValidationError(field, "contains control characters")
    return value


def machine_from_proto(
    pb: provider_pb2.Machine, *, now_unix_nanos: int = 0, interner: Interner | None = None
) -> Machine:
    """Validate and convert a provider `Machine`; raises `ValidationError` naming the bad field.

    Checks: id present, state and capacity type inside their enums, price finite and ≥ 0,
    interruption probability in [0, 1], quantities well-formed and non-negative, label sizes, and the
    per-state structure (`check_invariant`). Well-known shard_metadata is decoded into the
    assignment; malformed metadata values are skipped. The node name comes from the
    ``kubernetes.io/hostname`` label, else from ``bigfleet.lucy.sh/node-name`` metadata.
    """
    it = interner or DEFAULT_INTERNER
    mid = _text(pb.id, "id")
    if not mid:
        raise ValidationError("id", "must not be empty")
    raw_state = int(pb.state)
    if not 1 <= raw_state <= 8:
        raise ValidationError("state", f"unknown machine state {raw_state}")
    raw_ct = int(pb.capacity_type)
    if not 0 <= raw_ct <= 4:
        raise ValidationError("capacity_type", f"unknown capacity type {raw_ct}")
    price = float(pb.price_per_hour)
    prob = float(pb.interruption_probability)
    check_cost_fields(price, prob)
    resources = Resources.parse(pb.resources.resources, "resources")
    allocatable = Resources.parse(pb.allocatable.resources, "allocatable")
    # Label maps repeat across a fleet: validate and canonicalise each distinct one once.
    lkey = tuple(pb.labels.items())
    labels: Labels | None = it.lookup("labels-valid", lkey)
    if labels is None:
        labels = it.labels(_labels(pb.labels, "labels"))
        it.remember("labels-valid", lkey, labels)
    instance_type = _text(pb.instance_type, "instance_type")
    zone = _text(pb.zone, "zone")
    raw = (instance_type, zone, raw_ct, price, prob, labels, resources, allocatable)
    shape: MachineShape | None = it.lookup("shape-raw", raw)
    if shape is None:
        shape = it.intern("shape", MachineShape(
            it.string(instance_type),
            it.string(zone),
            CapacityType(raw_ct),
            it.intern("float", price),
            it.intern("float", prob),
            labels,
            it.intern("resources", resources),
            it.intern("resources", allocatable),
        ))
        it.remember("shape-raw", raw, shape)
    md = pb.shard_metadata
    assignment = NO_ASSIGNMENT
    if md:
        # Machines serving one need carry identical stamps: decode each distinct set once.
        akey = tuple(md.get(k) for k in WELL_KNOWN_METADATA_KEYS)
        cached: Assignment | None = it.lookup("metadata", akey)
        if cached is None:
            cached = decode_shard_metadata(md).apply_to(NO_ASSIGNMENT)
            it.remember("metadata", akey, cached)
        assignment = cached
    node = labels.get(HOSTNAME_LABEL) or md.get(META_NODE_NAME, "")
    if len(node) > MAX_TEXT_LEN or not node.isprintable():
        node = ""  # like any malformed metadata value: skipped, not fatal
    m = Machine(
        mid,
        MachineState(raw_state),
        shape=shape,
        assignment=assignment,
        cluster=_text(pb.cluster, "cluster"),
        host_provider=_text(pb.host.provider, "host.provider"),
        host_ref=_text(pb.host.ref, "host.ref", 1024),
        node_name=node,
        last_error=_text(pb.last_error, "last_error", 1 << 16).replace("\x00", ""),
        state_since_unix_nanos=now_unix_nanos,
        interner=it,
    )
    check_invariant(m)
    return m


def machine_to_proto(m: Machine, *, extra_metadata: Mapping[str, str] | None = None) -> provider_pb2.Machine:
    """The provider `Machine` for `m`; the assignment (if any) and a node name the provider's labels
    do not already carry are encoded into shard_metadata."""
    s = m.shape
    md: dict[str, str] = dict(extra_metadata or {})
    if m.assignment.need_fingerprint or m.cluster or not m.assignment.is_empty:
        md.update(encode_shard_metadata(m.assignment))
    if m.node_name and s.labels.get(HOSTNAME_LABEL) != m.node_name:
        md[META_NODE_NAME] = m.node_name
    pb = provider_pb2.Machine(
        id=m.id,
        state=int(m.state),  # type: ignore[arg-type]
        instance_type=s.instance_type,
        zone=s.zone,
        capacity_type=int(s.capacity_type),  # type: ignore[arg-type]
        price_per_hour=s.price_per_hour,
        interruption_probability=s.interruption_probability,
        labels=s.labels.to_dict(),
        last_error=m.last_error,
        cluster=m.cluster,
        shard_metadata=md,
    )
    if m.host_provider or m.host_ref:
        pb.host.provider = m.host_provider
        pb.host.ref = m.host_ref
    if s.resources:
        pb.resources.resources.update(s.resources.to_wire())
    if s.allocatable:
        pb.allocatable.resources.update(s.allocatable.to_wire())
    return pb
