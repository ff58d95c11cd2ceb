"""What the coordinator accepts on the wire, checked before anything reaches the replicated state.

A bad value written there is served back and acted on for ever: a shard id no shard can have
gets clusters placed on it, a cluster id the shard refuses binds an operator that can never roll
up, an unreachable Raft address joined to the group costs it its quorum. Each check raises
``BadRequest`` (the servicer answers INVALID_ARGUMENT with its text).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from bigfleet.needs.errors import ValidationError
from bigfleet.needs.requirements import MAX_LABEL_KEY_LEN, MAX_LABEL_VALUE_LEN
from bigfleet.needs.resources import Resources
from bigfleet.v1alpha1 import coordinator_pb2 as pb
from bigfleet.wire.needs import requirements_from_proto, validate_cluster_id

#: a HOST:PORT (or a gRPC target such as dns:///host:port) is never longer than this
MAX_ADDRESS_LEN = 512
#: shortfalls a report may carry (the coordinator keeps the first 100; the rest is bounded too)
MAX_SHORTFALLS = 10_000


class BadRequest(ValueError):
    """A request field the coordinator refuses; the message names the field."""


def check_id(value: str, field: str) -> None:
    """Cluster, shard and node ids: the shard's cluster-id rule (printable, no whitespace, ≤ 253)."""
    try:
        validate_cluster_id(value, field)
    except ValidationError as exc:
        raise BadRequest(str(exc)) from None


def check_address(value: str, field: str) -> tuple[str, int]:
    """[HOST]:PORT with a port in 1..65535 (a bracketed IPv6 host or a gRPC scheme prefix is fine)."""
    if not value:
        raise BadRequest(f"{field}: must not be empty")
    if len(value) > MAX_ADDRESS_LEN:
        raise BadRequest(f"{field}: longer than {MAX_ADDRESS_LEN} characters")
    if not value.isprintable() or any(c.isspace() for c in value):
        raise BadRequest(f"{field}: contains whitespace or control characters")
    host, sep, port = value.rpartition(":")
    # (an empty host, ":7443", is what `--listen :7443` advertises; it names no other machine, but a
    # shard that runs so has always been accepted, and refusing its heartbeats would take it out)
    if not sep or not port.isdigit() or not 0 < int(port) <= 65535:
        raise BadRequest(f"{field}: expected HOST:PORT with a port in 1..65535, got {value[:64]!r}")
    return host.strip("[]"), int(port)


def check_load_factor(value: float) -> None:
    """0 means the configured default; anything else must be a finite factor of at least 1."""
    if value and not (math.isfinite(value) and value >= 1.0):
        raise BadRequest(f"load_factor: must be a finite number >= 1 (or 0 for the default), got {value!r}")


def check_domain(key: str, value: str) -> None:
    """A topology domain is a node label: its key and value follow the roll-up's label bounds."""
    for field, text, limit in (("topology_key", key, MAX_LABEL_KEY_LEN), ("topology_value", value, MAX_LABEL_VALUE_LEN)):
        if len(text) > limit:
            raise BadRequest(f"{field}: longer than {limit} characters")
        if not text.isprintable() or any(c.isspace() for c in text):
            raise BadRequest(f"{field}: contains whitespace or control characters")


def check_report(r: pb.ShardReport) -> None:
    """A shard's heartbeat: its identity and address, summary counts and shortfalls."""
    check_id(r.shard_id, "shard_id")
    if r.shard_address:
        check_address(r.shard_address, "shard_address")
    if r.cycle < 0 or r.shard_epoch < 0:
        raise BadRequest("cycle and shard_epoch must not be negative")
    if r.HasField("summary"):
        _check_summary(r.summary)
    if len(r.shortfalls) > MAX_SHORTFALLS:
        raise BadRequest(f"shortfalls: {len(r.shortfalls)} entries, limit {MAX_SHORTFALLS}")
    for i, s in enumerate(r.shortfalls):
        _check_shortfall(s, f"shortfalls[{i}]")


def _check_summary(s: pb.ShardSummary) -> None:
    _non_negative("summary", (("total_machines", s.total_machines), ("free_machines", s.free_machines)))
    for name, counts in (("per_instance_type_counts", s.per_instance_type_counts), ("per_zone_counts", s.per_zone_counts)):
        _non_negative(f"summary.{name}", counts.items())
    if s.provider_address:
        check_address(s.provider_address, "summary.provider_address")


def _check_shortfall(s: pb.Shortfall, field: str) -> None:
    try:
        requirements_from_proto(s.requirements, f"{field}.requirements")
        Resources.parse(s.deficit.resources, f"{field}.deficit")
        Resources.parse(s.min_unit.resources, f"{field}.min_unit")
    except ValidationError as exc:
        raise BadRequest(str(exc)) from None
    if s.age_cycles < 0:
        raise BadRequest(f"{field}.age_cycles: must not be negative")
    if not 0 <= s.interruption_penalty_bucket <= 27:
        raise BadRequest(f"{field}.interruption_penalty_bucket: {s.interruption_penalty_bucket} out of range 0..27")


def _non_negative(field: str, counts: Iterable[tuple[str, int]]) -> None:
    for name, n in counts:
        if n < 0:
            raise BadRequest(f"{field}.{name}: {n} is negative")
