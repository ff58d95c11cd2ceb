"""Conversions between the demand protos (`capacity.proto`) and the domain types.

Everything arriving from the wire is validated here, once; a bad field raises ``ValidationError``
naming its path (``needs[3].requirements[0].values[2]``) and the caller rejects the whole roll-up.
"""

from __future__ import annotations

from collections.abc import Sequence

from bigfleet.needs.errors import ValidationError
from bigfleet.needs.penalty import PenaltyBucket
from bigfleet.needs.profile import Need, Profile
from bigfleet.needs.requirements import (
    MAX_LABEL_KEY_LEN,
    MAX_LABEL_VALUE_LEN,
    Operator,
    Requirement,
    TopologySpread,
    WhenUnsatisfiable,
)
from bigfleet.needs.resources import Resources
from bigfleet.v1alpha1 import capacity_pb2

# Bounds that keep a hostile roll-up cheap to reject. Generous next to any real cluster.
MAX_CLUSTER_ID_LEN = 253
# `group` is opaque: upstream operators build it as topologyKey + "\x00" + selector text,
# so any characters are accepted; only its length is bounded.
#: The co-location group limit every new roll-up is held to (docs/security.md). The shard applies
#: it at ingest (`bigfleet.security.limits.check_rollup`, before decoding); operators check each
#: CapacityRequest with `validate_group` so one over-long group skips that request, not the roll-up.
MAX_COLOCATION_GROUP_LEN = 253
#: What the decoder itself still accepts: roll-ups replicated before the 253 limit was enforced
#: must keep decoding when a new shard leader restores them (else that cluster's demand would
#: vanish on failover and its machines be reclaimed). Never raise it; new input never gets here.
MAX_GROUP_LEN = 4096
MAX_NEEDS_PER_ROLLUP = 100_000
MAX_REQUIREMENTS = 64
MAX_VALUES = 1024
MAX_SPREADS = 16
_MAX_INT32 = (1 << 31) - 1


def _check_text(value: str, field: str, max_len: int, *, allow_empty: bool = False) -> str:
    if not value:
        if allow_empty:
            return value
        raise ValidationError(field, "must not be empty")
    if len(value) > max_len:
        raise ValidationError(field, f"longer than {max_len} characters")
    if not value.isprintable():
        raise ValidationError(field, "contains control characters")
    return value


def validate_cluster_id(cluster_id: str, field: str = "cluster_id") -> str:
    """A cluster id must be a non-empty, printable string of at most 253 characters without spaces."""
    _check_text(cluster_id, field, MAX_CLUSTER_ID_LEN)
    if any(c.isspace() for c in cluster_id):
        raise ValidationError(field, "contains whitespace")
    return cluster_id


def validate_group(group: str, field: str = "group") -> str:
    """A co-location group may be empty; otherwise at most 253 characters (any characters)."""
    if len(group) > MAX_COLOCATION_GROUP_LEN:
        raise ValidationError(field, f"{len(group)} characters, limit {MAX_COLOCATION_GROUP_LEN}")
    return group


def requirement_from_proto(pb: capacity_pb2.NodeSelectorRequirement, field: str = "") -> Requirement:
    """Validate and convert one requirement (unknown/unspecified operators are rejected)."""
    key = _check_text(pb.key, _join(field, "key"), MAX_LABEL_KEY_LEN)
    if any(c.isspace() for c in key):
        raise ValidationError(_join(field, "key"), "contains whitespace")
    raw_op = int(pb.operator)
    if raw_op not in _OPERATORS:
        raise ValidationError(_join(field, "operator"), f"unknown operator {raw_op}")
    op = Operator(raw_op)
    values = tuple(pb.values)
    if len(values) > MAX_VALUES:
        raise ValidationError(_join(field, "values"), f"more than {MAX_VALUES} values")
    for i, v in enumerate(values):
        _check_text(v, f"{_join(field, 'values')}[{i}]", MAX_LABEL_VALUE_LEN)
    if op in (Operator.IN, Operator.NOT_IN) and not values:
        raise ValidationError(_join(field, "values"), f"{op.k8s_name} needs at least one value")
    if op in (Operator.EXISTS, Operator.DOES_NOT_EXIST) and values:
        raise ValidationError(_join(field, "values"), f"{op.k8s_name} takes no values")
    return Requirement(key, op, values)


_OPERATORS = frozenset(int(o) for o in Operator if o is not Operator.UNSPECIFIED)


def requirement_to_proto(r: Requirement) -> capacity_pb2.NodeSelectorRequirement:
    return capacity_pb2.NodeSelectorRequirement(
        key=r.key,
        operator=int(r.operator),  # type: ignore[arg-type]
        values=list(r.values),
    )


def requirements_from_proto(
    pbs: Sequence[capacity_pb2.NodeSelectorRequirement], field: str = "requirements"
) -> tuple[Requirement, ...]:
    if len(pbs) > MAX_REQUIREMENTS:
        raise ValidationError(field, f"more than {MAX_REQUIREMENTS} requirements")
    return tuple(requirement_from_proto(r, f"{field}[{i}]") for i, r in enumerate(pbs))


def spread_from_proto(pb: capacity_pb2.TopologySpread, field: str = "") -> TopologySpread:
    key = _check_text(pb.topology_key, _join(field, "topology_key"), MAX_LABEL_KEY_LEN)
    raw = int(pb.when_unsatisfiable)
    if raw not in _WHEN:
        raise ValidationError(_join(field, "when_unsatisfiable"), f"unknown value {raw}")
    # max_skew < 1 is clamped to 1 by TopologySpread (the engine treats it so).
    return TopologySpread(key, int(pb.max_skew), WhenUnsatisfiable(raw))


_WHEN = frozenset(int(w) for w in WhenUnsatisfiable)


def spread_to_proto(s: TopologySpread) -> capacity_pb2.TopologySpread:
    return capacity_pb2.TopologySpread(
        topology_key=s.topology_key,
        max_skew=s.max_skew,
        when_unsatisfiable=int(s.when_unsatisfiable),  # type: ignore[arg-type]
    )


def _bucket(raw: int, field: str) -> PenaltyBucket:
    if not 0 <= raw <= int(PenaltyBucket.PINNED):
        raise ValidationError(field, f"penalty bucket {raw} out of range 0..27")
    return PenaltyBucket(raw)


# Operators resend the same profiles every 10 s: remember validated Profiles by their raw wire content
# (bounded; cleared when full) so a steady-state roll-up skips validation, sorting and hashing.
_PROFILE_CACHE: dict[tuple[object, ...], Profile] = {}
_PROFILE_CACHE_MAX = 50_000


def profile_from_proto(pb: capacity_pb2.CapacityNeed, field: str = "") -> Profile:
    """The aggregation key of a `CapacityNeed` (everything but the resource vectors)."""
    key = (
        tuple((r.key, r.operator, tuple(r.values)) for r in pb.requirements),
        tuple((s.topology_key, s.max_skew, s.when_unsatisfiable) for s in pb.spread),
        pb.priority,
        pb.interruption_penalty_bucket,
        pb.reclamation_penalty_bucket,
        pb.group,
    )
    hit = _PROFILE_CACHE.get(key)
    if hit is not None:
        return hit
    profile = _profile_from_proto(pb, field)
    if len(_PROFILE_CACHE) >= _PROFILE_CACHE_MAX:
        _PROFILE_CACHE.clear()
    _PROFILE_CACHE[key] = profile
    return profile


def _profile_from_proto(pb: capacity_pb2.CapacityNeed, field: str) -> Profile:
    reqs = requirements_from_proto(pb.requirements, _join(field, "requirements"))
    if len(pb.spread) > MAX_SPREADS:
        raise ValidationError(_join(field, "spread"), f"more than {MAX_SPREADS} spread terms")
    spread = tuple(spread_from_proto(s, f"{_join(field, 'spread')}[{i}]") for i, s in enumerate(pb.spread))
    group = pb.group
    if len(group) > MAX_GROUP_LEN:
        raise ValidationError(_join(field, "group"), f"longer than {MAX_GROUP_LEN} characters")
    return Profile(
        requirements=reqs,
        spread=spread,
        priority=int(pb.priority),
        interruption_bucket=_bucket(int(pb.interruption_penalty_bucket), _join(field, "interruption_penalty_bucket")),
        reclamation_bucket=_bucket(int(pb.reclamation_penalty_bucket), _join(field, "reclamation_penalty_bucket")),
        group=group,
    )


def need_from_proto(pb: capacity_pb2.CapacityNeed, cluster_id: str, now_unix_nanos: int, field: str = "") -> Need:
    """Validate and convert one `CapacityNeed`; its arrival time is `now_unix_nanos`."""
    profile = profile_from_proto(pb, field)
    agg = Resources.parse(pb.aggregate_resources, _join(field, "aggregate_resources"))
    unit = Resources.parse(pb.min_unit, _join(field, "min_unit"))
    return Need(cluster_id, profile, agg, unit, now_unix_nanos)


def need_to_proto(need: Need) -> capacity_pb2.CapacityNeed:
    p = need.profile
    return capacity_pb2.CapacityNeed(
        requirements=[requirement_to_proto(r) for r in p.requirements],
        aggregate_resources=need.aggregate_resources.to_wire(),
        priority=p.priority,
        spread=[spread_to_proto(s) for s in p.spread],
        interruption_penalty_bucket=int(p.interruption_bucket),  # type: ignore[arg-type]
        reclamation_penalty_bucket=int(p.reclamation_bucket),  # type: ignore[arg-type]
        min_unit=need.min_unit.to_wire(),
        group=p.group,
    )


def rollup_from_proto(pb: capacity_pb2.ClusterCapacityNeeds, now_unix_nanos: int) -> tuple[str, list[Need]]:
    """Validate a whole roll-up; any bad field rejects all of it (the last good demand stays)."""
    cluster_id = validate_cluster_id(pb.cluster_id)
    if len(pb.needs) > MAX_NEEDS_PER_ROLLUP:
        raise ValidationError("needs", f"more than {MAX_NEEDS_PER_ROLLUP} needs")
    needs = [need_from_proto(n, cluster_id, now_unix_nanos, f"needs[{i}]") for i, n in enumerate(pb.needs)]
    return cluster_id, needs


def rollup_to_proto(cluster_id: str, needs: Sequence[Need], timestamp_unix_nanos: int = 0) -> capacity_pb2.ClusterCapacityNeeds:
    return capacity_pb2.ClusterCapacityNeeds(
        cluster_id=cluster_id,
        timestamp_unix_nanos=timestamp_unix_nanos,
        needs=[need_to_proto(n) for n in needs],
    )


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
