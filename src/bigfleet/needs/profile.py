"""`Profile` (the aggregation key of demand) and `Need` (one NeedsTable row)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from bigfleet.needs.penalty import PenaltyBucket, bucket_dollars
from bigfleet.needs.requirements import Operator, Requirement, TopologySpread
from bigfleet.needs.resources import EMPTY, Resources

_setattr = object.__setattr__

# Bump only together with a migration story: fingerprints are stamped on machines via shard_metadata.
FINGERPRINT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Profile:
    """What demand aggregates on: requirements, spread, priority, both penalty buckets and the group.

    Construction canonicalises: requirements and spreads are sorted and de-duplicated (a conjunction
    and a set of spread terms carry no order), requirement values are sorted. The resource shape is
    deliberately not part of a Profile (``min_unit`` lives on `Need`), so a machine's stamped
    fingerprint survives pods of a different size joining the same need.
    """

    requirements: tuple[Requirement, ...] = ()
    spread: tuple[TopologySpread, ...] = ()
    priority: int = 0
    interruption_bucket: PenaltyBucket = PenaltyBucket.UNSPECIFIED
    reclamation_bucket: PenaltyBucket = PenaltyBucket.UNSPECIFIED
    group: str = ""
    _fingerprint: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        reqs = tuple(sorted(set(self.requirements), key=Requirement.sort_key))
        if reqs != self.requirements:
            _setattr(self, "requirements", reqs)
        spr = tuple(sorted(set(self.spread), key=TopologySpread.sort_key))
        if spr != self.spread:
            _setattr(self, "spread", spr)
        if type(self.interruption_bucket) is not PenaltyBucket:
            _setattr(self, "interruption_bucket", PenaltyBucket(self.interruption_bucket))
        if type(self.reclamation_bucket) is not PenaltyBucket:
            _setattr(self, "reclamation_bucket", PenaltyBucket(self.reclamation_bucket))
        _setattr(self, "_fingerprint", self._compute_fingerprint())

    def _compute_fingerprint(self) -> str:
        # JSON of plain lists/ints/strings is an injective encoding, identical in every process.
        doc = [
            FINGERPRINT_VERSION,
            int(self.priority),
            int(self.interruption_bucket),
            int(self.reclamation_bucket),
            self.group,
            [[r.key, int(r.operator), list(r.values)] for r in self.requirements],
            [[s.topology_key, s.max_skew, int(s.when_unsatisfiable)] for s in self.spread],
        ]
        blob = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def __hash__(self) -> int:
        return hash(self._fingerprint)

    def fingerprint(self) -> str:
        """Content-addressed hex id (32 hex digits), stable across processes and runs."""
        return self._fingerprint

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a machine with `labels` passes every requirement (Same: only key presence/values)."""
        return all(r.matches(labels) for r in self.requirements)

    @property
    def same(self) -> Requirement | None:
        """The honoured co-location requirement (the first Same in canonical order), if any."""
        for r in self.requirements:
            if r.operator is Operator.SAME:
                return r
        return None

    @property
    def strict_spread(self) -> TopologySpread | None:
        """The enforced spread (first DoNotSchedule term); ignored when the profile has a Same."""
        if self.same is not None:
            return None
        for s in self.spread:
            if s.strict:
                return s
        return None

    @property
    def interruption_penalty_dollars(self) -> float:
        return bucket_dollars(self.interruption_bucket)

    @property
    def reclamation_penalty_dollars(self) -> float:
        return bucket_dollars(self.reclamation_bucket)

    @classmethod
    def build(
        cls,
        requirements: Iterable[Requirement] = (),
        spread: Iterable[TopologySpread] = (),
        priority: int = 0,
        interruption_bucket: PenaltyBucket | int = PenaltyBucket.UNSPECIFIED,
        reclamation_bucket: PenaltyBucket | int = PenaltyBucket.UNSPECIFIED,
        group: str = "",
    ) -> Profile:
        """Convenience constructor accepting any iterables and plain ints."""
        return cls(
            tuple(requirements),
            tuple(spread),
            int(priority),
            PenaltyBucket(interruption_bucket),
            PenaltyBucket(reclamation_bucket),
            group,
        )


@dataclass(frozen=True, slots=True)
class Need:
    """One row of demand: a cluster wants `aggregate_resources` of machines matching `profile`.

    Every machine credited or acquired for the need must individually cover `min_unit`.
    `arrival_unix_nanos` is the age clock (older needs win ties and age into preemption).
    """

    cluster_id: str
    profile: Profile
    aggregate_resources: Resources = EMPTY
    min_unit: Resources = EMPTY
    arrival_unix_nanos: int = 0

    @property
    def priority(self) -> int:
        return self.profile.priority

    @property
    def fingerprint(self) -> str:
        return self.profile._fingerprint

    @property
    def requirements(self) -> tuple[Requirement, ...]:
        return self.profile.requirements

    @property
    def spread(self) -> tuple[TopologySpread, ...]:
        return self.profile.spread

    @property
    def group(self) -> str:
        return self.profile.group

    @property
    def interruption_bucket(self) -> PenaltyBucket:
        return self.profile.interruption_bucket

    @property
    def reclamation_bucket(self) -> PenaltyBucket:
        return self.profile.reclamation_bucket

    @property
    def key(self) -> tuple[str, str]:
        """``(cluster_id, fingerprint)``: the row's identity in a NeedsTable."""
        return (self.cluster_id, self.profile._fingerprint)

    def with_arrival(self, arrival_unix_nanos: int) -> Need:
        return Need(self.cluster_id, self.profile, self.aggregate_resources, self.min_unit, arrival_unix_nanos)

    def same_demand(self, other: Need) -> bool:
        """Equal in everything but arrival time (what `NeedsTable.replace` treats as "unchanged")."""
        return (
            self.cluster_id == other.cluster_id
            and self.profile == other.profile
            and self.aggregate_resources == other.aggregate_resources
            and self.min_unit == other.min_unit
        )


def merge_needs(needs: Iterable[Need]) -> list[Need]:
    """Fold needs sharing ``(cluster, fingerprint)``: sum aggregates, max min_units, earliest non-zero arrival.

    Output keeps first-seen order. This is the operator-side aggregation rule, applied again by
    the table so a roll-up that repeats a profile cannot create two rows for one key.
    """
    out: dict[tuple[str, str], Need] = {}
    for n in needs:
        k = n.key
        prev = out.get(k)
        if prev is None:
            out[k] = n
            continue
        arrivals = [a for a in (prev.arrival_unix_nanos, n.arrival_unix_nanos) if a]
        out[k] = Need(
            n.cluster_id,
            prev.profile,
            prev.aggregate_resources + n.aggregate_resources,
            prev.min_unit.max(n.min_unit),
            min(arrivals) if arrivals else 0,
        )
    return list(out.values())
