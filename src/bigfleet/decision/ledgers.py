"""The carried ledgers after a cycle: unmet ages, gang parking, shortfalls (summed per profile).

Under a lasting stockout most short needs sit in reused clusters whose rows do not change from one
cycle to the next; only their ages move. Their shortfall groups (`CarriedShort`) are carried across
cycles and updated by the clusters that joined or left, so a steady cycle costs what changed plus
one C-level age lookup per short need.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from itertools import chain, repeat
from operator import add, attrgetter, itemgetter, sub

from bigfleet.needs import EMPTY_RESOURCES, Resources

from .scratch import CycleScratch, NeedRow
from .types import EngineConfig, EngineState, Shortfall
from .vec import Vec, to_resources
from .verdicts import unmet_reason

_PRECEDENCE = attrgetter("order")


@dataclass(frozen=True)
class Ledgers:
    """What the cycle's recomputed needs leave for the next cycle and the report."""

    unmet_ages: dict[str, int]
    parking: dict[str, int]
    shortfall_ages: dict[str, int]
    shortfalls: list[Shortfall]
    unsatisfied: int
    unresolved: int


class ShortPart:
    """A reused cluster's short rows as the ledgers count them: fixed while its cache entry lives
    (no gang, nothing acquired or preempted, so `remaining` is the Phase-1 deficit); only `ages`
    moves, set each cycle by `age`."""

    __slots__ = ("ages", "by_fp", "cluster", "count", "keys")

    def __init__(self, cluster: str, rows: Sequence[NeedRow]) -> None:
        self.cluster = cluster
        self.count = len(rows)
        #: the rows' need keys, sorted and distinct (the carried state's order)
        age_of = {n.key: n.unmet_age for n in rows}
        self.keys = sorted(age_of)
        self.ages = [age_of[k] for k in self.keys]
        #: fingerprint → (rows, their summed deficit, the first in precedence order)
        by_fp: dict[str, tuple[int, Vec, NeedRow]] = {}
        for n in rows:
            got = by_fp.get(n.fp)
            if got is None:
                by_fp[n.fp] = (1, n.remaining, n)
            else:
                k, vec, head = got
                by_fp[n.fp] = (k + 1, tuple(map(add, vec, n.remaining)), n if n.order < head.order else head)
        self.by_fp = by_fp

    def age(self, prev: Mapping[str, int], emitted: bool) -> list[int]:
        """This cycle's unmet age of each key: one more than the carried one (C-level). `emitted`:
        `prev` is the very map the engine emitted last cycle, which holds `self.ages` for these keys
        (the part was built or aged in that cycle), so no lookup is needed."""
        if emitted:
            self.ages = list(map(add, self.ages, repeat(1)))
        else:
            self.ages = list(map(add, map(prev.get, self.keys, repeat(0)), repeat(1)))
        return self.ages


class _Group:
    """One fingerprint's rows over the carried clusters."""

    __slots__ = ("clusters", "count", "deficit", "head", "heads", "units")

    def __init__(self, deficit: Vec) -> None:
        self.count = 0
        self.deficit = deficit
        self.heads: dict[str, NeedRow] = {}
        #: the heads' min units, counted: a reported shortfall's min unit is their max, and a few
        #: distinct values stand for hundreds of heads (re-hashing every head's each cycle cost
        #: ~70 ms of a persistent-unmet steady cycle)
        self.units: dict[Resources, int] = {}
        #: the first row in precedence order; None when it left and is not yet recomputed
        self.head: NeedRow | None = None
        self.clusters: list[str] = []

    def first(self) -> NeedRow:
        if self.head is None:
            self.head = min(self.heads.values(), key=_PRECEDENCE)
        return self.head


class CarriedShort:
    """Shortfall groups of the reused short clusters, carried between cycles. `sync` files the
    clusters that joined and removes those that left (compared by `ShortPart` identity: a cluster
    recomputed gets a new part), so it costs what changed; nothing here survives a restart, and
    a fresh one gives the same groups."""

    def __init__(self) -> None:
        self.members: dict[str, ShortPart] = {}
        self.groups: dict[str, _Group] = {}
        self.count = 0
        self.dims: tuple[str, ...] = ()
        #: the need keys of last cycle's unmet ages, chunk by chunk (see `_key_sorted`)
        self.last_keys: list[list[str]] = []

    def sync(self, parts: Mapping[str, ShortPart], dims: tuple[str, ...]) -> None:
        if dims != self.dims:  # (every cache entry is rebuilt then; deficits are per dimension order)
            self.members, self.groups, self.count, self.dims = {}, {}, 0, dims
        members = self.members
        leaving = [p for c, p in members.items() if c not in parts]
        for c, p in parts.items():
            old = members.get(c)
            if old is not p:
                if old is not None:
                    self._remove(old)
                self._add(p)
        for p in leaving:  # after the joins: a joining head spares recomputing a leaving one
            self._remove(p)

    def _add(self, part: ShortPart) -> None:
        c = part.cluster
        groups = self.groups
        for fp, (k, vec, head) in part.by_fp.items():
            g = groups.get(fp)
            if g is None:
                g = groups[fp] = _Group(vec)
                g.head = head
            else:
                g.deficit = tuple(map(add, g.deficit, vec))
                if g.head is not None and head.order < g.head.order:
                    g.head = head
            g.count += k
            g.heads[c] = head
            u = head.need.min_unit
            g.units[u] = g.units.get(u, 0) + 1
            insort(g.clusters, c)
        self.members[c] = part
        self.count += part.count

    def _remove(self, part: ShortPart) -> None:
        c = part.cluster
        groups = self.groups
        for fp, (k, vec, head) in part.by_fp.items():
            g = groups[fp]
            g.count -= k
            if not g.count:
                del groups[fp]
                continue
            g.deficit = tuple(map(sub, g.deficit, vec))
            del g.heads[c]
            u = head.need.min_unit
            left = g.units[u] - 1
            if left:
                g.units[u] = left
            else:
                del g.units[u]
            if g.head is head:
                g.head = None
            del g.clusters[bisect_left(g.clusters, c)]
        del self.members[c]
        self.count -= part.count


def ledgers(cy: CycleScratch, rows: Iterable[NeedRow], state: EngineState, config: EngineConfig,
            carried: CarriedShort | None = None, emitted: Mapping[str, int] | None = None) -> Ledgers:
    """Unmet ages and parking from the Phase-1 deficit; shortfalls from what Phase 2 left short.

    `carried`: the reused clusters' short rows, each short by the same amount after Phase 1 and
    Phase 2 and no gang (the `UnmetWatch` conditions), already grouped by fingerprint. A profile's
    shortfall takes its fields from its first row in precedence order, and only the reported head
    of the shortfall list is built. `emitted`: the unmet ages `carried` last went into, when
    `state` carries that very map (it then serves as the copy to update; see `_key_sorted`).
    """
    unmet: dict[str, dict[str, int]] = {}
    parking: dict[str, int] = {}
    short: dict[str, list[NeedRow]] = {}
    n_unsat = n_unresolved = 0
    for n in rows:
        if not any(n.p1_remaining):
            continue
        if n.same is not None and not (n.acquired_idle or n.acquired_spec or n.same_sat):
            parking[n.park_key] = n.park_age + 1
        n_unsat += 1
        unmet.setdefault(n.cluster, {})[n.key] = n.unmet_age
        if n.remaining is n.p1_remaining or any(n.remaining):
            got = short.get(n.fp)
            if got is None:
                short[n.fp] = [n]
            else:
                got.append(n)
            n_unresolved += 1
    if carried is None:
        carried = CarriedShort()
    n_unsat += carried.count
    n_unresolved += carried.count
    chunks = [(c, [k for k, _ in items], [a for _, a in items])
              for c, ages in unmet.items() for items in (sorted(ages.items()),)]
    chunks += [(p.cluster, p.keys, p.ages) for p in carried.members.values()]
    old_ages = state.shortfall_ages
    groups = carried.groups
    ages = {fp: old_ages.get(fp, 0) + 1 for fp in (short.keys() | groups.keys())}
    heads = {fp: _head(short.get(fp), groups.get(fp)) for fp in ages}
    cap = max(0, config.shortfall_report_cap)
    reported = heapq.nsmallest(cap, ages, key=lambda fp: (-heads[fp].prio, -ages[fp], fp))
    shortfalls = [_shortfall(cy, fp, short.get(fp, []), groups.get(fp), heads[fp], ages[fp], config)
                  for fp in reported]
    return Ledgers(_key_sorted(chunks, carried, emitted), parking, ages, shortfalls, n_unsat, n_unresolved)


def _head(rows: list[NeedRow] | None, group: _Group | None) -> NeedRow:
    """The first row in precedence order (rows of different clusters never tie)."""
    if group is None:
        assert rows
        return rows[0] if len(rows) == 1 else min(rows, key=_PRECEDENCE)
    head = group.first()
    if rows:
        fresh = min(rows, key=_PRECEDENCE)
        if fresh.order < head.order:
            return fresh
    return head


def _key_sorted(chunks: list[tuple[str, list[str], list[int]]], carried: CarriedShort | None = None,
                emitted: Mapping[str, int] | None = None) -> dict[str, int]:
    """Unmet ages in key order from per-cluster sorted chunks: a need key is its cluster, a NUL and
    its fingerprint, so the chunks in cluster order are already in key order (checked at each
    chunk boundary; a full sort otherwise).

    When the keys are last cycle's (`carried.last_keys`, chunk by chunk) and `emitted` is the map
    built from them, that map is copied and its values updated: the same keys in the same order,
    without re-inserting (and re-hashing through every resize) 44 000 keys.
    """
    chunks.sort(key=itemgetter(0))
    keys_now = [keys for _c, keys, _a in chunks]
    out: dict[str, int]
    if carried is not None:
        before, carried.last_keys = carried.last_keys, keys_now
        if (isinstance(emitted, dict) and len(before) == len(keys_now)
                and all(a is b or a == b for a, b in zip(before, keys_now, strict=True))
                and len(emitted) == sum(map(len, keys_now))):
            out = emitted.copy()
            for _c, keys, ages in chunks:
                out.update(zip(keys, ages, strict=True))
            return out
    out = {}
    last = ""
    in_order = True
    for _c, keys, ages in chunks:
        if keys:
            if keys[0] <= last:
                in_order = False
            out.update(zip(keys, ages, strict=True))
            last = keys[-1]
    return out if in_order else dict(sorted(out.items()))


def _shortfall(cy: CycleScratch, fp: str, rows: list[NeedRow], group: _Group | None, head: NeedRow, age: int,
               config: EngineConfig) -> Shortfall:
    deficit = tuple(map(sum, zip(*[n.remaining for n in rows], strict=True))) if rows else cy.zero
    clusters = sorted({n.cluster for n in rows})
    if group is not None:
        deficit = tuple(map(add, deficit, group.deficit)) if rows else group.deficit
        merged = group.clusters.copy()  # (recomputed clusters are never carried ones)
        for c in clusters:
            insort(merged, c)
        clusters = merged
    return Shortfall(
        fingerprint=fp,
        requirements=head.reqs,
        deficit=to_resources(cy.dims, deficit),
        priority=head.prio,
        age_cycles=age,
        interruption_bucket=head.ib,
        reason=unmet_reason(cy, head, True),
        clusters=tuple(clusters),
        escalated=age > config.escalation_after_cycles,
        min_unit=_min_unit(rows, group.units if group is not None else {}),
    )


def _min_unit(rows: Iterable[NeedRow], carried: Iterable[Resources]) -> Resources:
    """The per-dimension max of the rows' and the carried heads' min units."""
    return reduce(Resources.max, chain({n.need.min_unit for n in rows}, carried), EMPTY_RESOURCES)
