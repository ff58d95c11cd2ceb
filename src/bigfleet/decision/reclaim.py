"""Phase 3, reclaim: a cluster's Configured machines credited to no need drain, capped per cycle.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from itertools import chain, filterfalse
from operator import attrgetter
from typing import Protocol

from bigfleet.machine.record import Machine

from .index import (
    CONFIGURED,
    BoundDelta,
    m_reclamation,
)
from .scratch import CycleScratch
from .types import (
    Action,
    Drain,
    EngineConfig,
    EngineState,
)


def excess_drains(cy: CycleScratch, cluster: str, grace: int, limit: int, exclude: set[str],
                  memo: ReclaimMemo | None = None) -> tuple[list[Drain], int]:
    """The first `limit` reclaim drains of the cluster's unclaimed Configured machines, cheapest to
    lose first (reclamation asc, price desc, id desc), and how many such machines there are.

    Each class list is kept in keep order (reclamation desc, id asc), so read from its end it is a
    series of equal-penalty segments in reclaim order; buckets of the classes' next segments yield
    them bucket by bucket (equal reclamation and price), and only a bucket spanning several classes
    needs an id sort (C-level). With `memo` (a cached cluster, nothing excluded) the walk resumes
    where the last cycle's stopped when only explored machines left since (see `ReclaimWalk`).
    """
    by_class = cy.ix.bound.get(cluster, {}).get(CONFIGURED, {})
    total = cy.ix.configured_count.get(cluster, 0) - cy.hconf.get(cluster, 0)
    if total <= 0:  # (every Configured machine held: the held map is not read, see `ClusterHeld`)
        return [], 0
    h = cy.held.get(cluster)
    held = h.ids() if h is not None else {}
    unheld = total
    if exclude:
        total -= sum(1 for lst in by_class.values() for m in lst if m.id in exclude and m.id not in held)
    if total <= 0 or limit <= 0:
        return [], max(0, total)
    if memo is None or exclude:
        walk = ReclaimWalk(cy, by_class, held, False, unheld, -1)
    else:
        # the proof reads every unheld machine once: worth it only for a walk that may be resumed,
        # and bounded by what this cycle issues (a cluster recomputed every cycle starts a walk
        # every cycle)
        prove = unheld <= _PROOF_READS_PER_DRAIN * limit
        walk = _resumed(cy, cluster, memo.walk, by_class, held, prove, unheld)
        memo.walk = walk
    ids = walk.first(by_class, exclude, limit)
    proto = {"machine_id": "", "cluster_id": cluster, "grace_period_seconds": grace, "preemptor_priority": 0,
             "reason": "reclaim", "kind": "drain"}
    new, set_attr = object.__new__, object.__setattr__
    out: list[Drain] = []
    for mid in ids:  # (as `records.build_fast`: one C-level dict copy per record, no field-by-field init)
        fields = proto.copy()
        fields["machine_id"] = mid
        d = new(Drain)
        set_attr(d, "__dict__", fields)
        out.append(d)
    return out, total


class ReclaimWalk:
    """A cached cluster's reclaim order explored so far: `ids` (unheld, in order; whole buckets) and
    each class's next unexplored segment, by bucket.

    Valid next cycle while the cluster keeps its held set (its `ClusterCache` lives on) and its bound
    lists only lost machines this walk had explored: those sit at or past each segment entry's position,
    so the positions still hold, and dropping them from `ids` leaves a prefix of the new order. A
    reclaim wave (each cycle's drains start) then costs the drains, not a re-read of every held
    machine in the buckets it passes again (which grew with every wave).

    Crediting takes a class's machines in keep order, so a class's held machines are usually a
    prefix of its list. When `held_prefixes` proves that for every class, the walk starts each class
    at its first unheld machine and never reads a held one (nor visits a bucket of held ones only)."""

    __slots__ = ("buckets", "checked", "held", "ids", "seen", "starts", "ver")

    def __init__(self, cy: CycleScratch, by_class: dict[int, list[Machine]], held: Mapping[str, object],
                 prove: bool, unheld: int, ver: int) -> None:
        """`prove`: try `held_prefixes` (`unheld`: the cluster's unheld Configured count)."""
        classes = cy.ix.classes
        starts = held_prefixes(by_class, held, unheld) if prove else None
        #: class → its first unheld position (absent: 0); None when the prefixes are not proven, so
        #: the walk reads every machine and filters the held ones out
        self.starts = starts
        #: the held ids the walk must filter out ({} when `starts` proves none is in its way)
        self.held: Mapping[str, object] = held if starts is None else {}
        #: (reclamation, -price) → (class, end) of each class's next unexplored segment with that
        #: key: a bucket is a dict entry, so each segment costs one append instead of a heap push
        #: and pop over every class of the cluster (tuple compares of equal keys, ~2 000
        #: instructions a segment); the next bucket is the least key (a few dozen at most)
        self.buckets: dict[tuple[float, float], list[tuple[int, int]]] = {}
        low = starts or {}
        for ci, lst in by_class.items():
            if low.get(ci, 0) < len(lst):
                _add_segment(self.buckets, (m_reclamation(lst[-1]), -classes[ci].shape.price_per_hour), ci, len(lst))
        self.ids: list[str] = []
        self.seen: set[str] = set()
        self.ver = ver
        #: the last sync log `explored_all` found covered (both the cache and the resume ask)
        self.checked: BoundDelta | None = None

    def explored_all(self, log: BoundDelta) -> bool:
        """Whether the sync `log` took from the cluster only machines this walk had explored (so
        unheld ones), starting from the version the walk is at."""
        if log is self.checked:
            return True
        if log.before != self.ver or not self.seen.issuperset(log.removed):
            return False
        self.checked = log
        return True

    def first(self, by_class: dict[int, list[Machine]], exclude: set[str], limit: int) -> list[str]:
        """Ids of the first `limit` unheld, unexcluded machines in reclaim order (exploring on)."""
        buckets, out, held, low = self.buckets, self.ids, self.held, self.starts or {}
        while buckets and len(out) < limit:
            key = min(buckets)
            r, neg_price = key
            segs: list[list[Machine]] = []
            for ci, hi in buckets.pop(key):
                lst = by_class[ci]
                start = low.get(ci, 0)
                lo = start if m_reclamation(lst[start]) == r else bisect_left(lst, -r, start, hi,
                                                                              key=_negated_reclamation)
                segs.append(lst[lo:hi])
                if lo > start:  # (a higher reclamation: never this bucket's key)
                    _add_segment(buckets, (m_reclamation(lst[lo - 1]), neg_price), ci, lo)
            # ids first (one touch per record), held ones out, and only the rest sorted (id desc)
            ids = list(map(_MACHINE_ID, chain.from_iterable(segs) if len(segs) > 1 else segs[0]))
            if held:  # (C-level filters: a Python test per id cost ~0.4 µs)
                ids = list(filterfalse(held.__contains__, ids))
            if exclude:
                ids = list(filterfalse(exclude.__contains__, ids))
            ids.sort(reverse=True)
            self.seen.update(ids)
            out.extend(ids)
        return out[:limit]


def held_prefixes(by_class: Mapping[int, list[Machine]], held: Mapping[str, object], unheld: int
                  ) -> dict[int, int] | None:
    """Each class's count of leading held machines (classes with none left out), if every held
    machine of the classes leads its list; else None.

    Proof, not trust: each boundary is found by binary search (right when the held ones lead), then
    every machine after a boundary is checked unheld and their number must be `unheld`, the cluster's
    count of unheld ones, so no unheld machine can sit before a boundary."""
    if not held:
        return {}
    has = held.__contains__
    starts: dict[int, int] = {}
    tails: list[list[Machine]] = []
    found = 0
    for ci, lst in by_class.items():
        size = len(lst)
        if not has(lst[0].id):
            p = 0
        elif has(lst[-1].id):
            p = size
        else:
            p = bisect_left(lst, True, 1, size - 1, key=lambda m: m.id not in held)
        if p:
            starts[ci] = p
        if p < size:
            tails.append(lst[p:] if p else lst)
            found += size - p
    if found != unheld or not held.keys().isdisjoint(map(_MACHINE_ID, chain.from_iterable(tails))):
        return None
    return starts


def _add_segment(buckets: dict[tuple[float, float], list[tuple[int, int]]], key: tuple[float, float], ci: int,
                 hi: int) -> None:
    got = buckets.get(key)
    if got is None:
        buckets[key] = [(ci, hi)]
    else:
        got.append((ci, hi))


def _resumed(cy: CycleScratch, cluster: str, walk: ReclaimWalk | None, by_class: dict[int, list[Machine]],
             held: Mapping[str, object], prove: bool, unheld: int) -> ReclaimWalk:
    """Last cycle's walk, with the machines that left dropped, when still valid; else a fresh one."""
    ver = cy.ix.cluster_ver.get(cluster, 0)
    if walk is not None and walk.ver != ver:
        log = cy.ix.bound_log.get(cluster)
        if log is None or log.added or not walk.explored_all(log):
            walk = None
        else:
            gone = set(log.removed)
            walk.ids = list(filterfalse(gone.__contains__, walk.ids))
            walk.ver = ver
    return walk if walk is not None else ReclaimWalk(cy, by_class, held, prove, unheld, ver)


def _negated_reclamation(m: Machine) -> float:
    """``-m_reclamation(m)``, inlined: the bisect calls it ~6 times a segment."""
    v = m.assignment.reclamation_penalty_dollars
    return -0.0 if v != v or v < 0 else -v


_MACHINE_ID = attrgetter("id")

#: a walk tries `held_prefixes` only when the cluster's unheld machines (what the proof reads) are
#: at most this many per drain the cycle may issue
_PROOF_READS_PER_DRAIN = 16


def reclaim_cap(configured: int, fraction: float) -> int:
    return max(1, math.floor(fraction * configured)) if fraction > 0 else configured


class ReclaimMemo(Protocol):
    """A cached cluster's reclaim drains, reusable while its (grace, cap fraction) is unchanged, and
    its reclaim walk (see `ReclaimWalk`)."""

    drains: tuple[tuple[int, float], list[Drain], int] | None
    walk: ReclaimWalk | None


def reclaim_all(cy: CycleScratch, state: EngineState, config: EngineConfig, preempts: Sequence[Action],
                memos: Mapping[str, ReclaimMemo], needs_of: Mapping[str, object]) -> tuple[list[Action], int]:
    """Phase 3 reclaims of every cluster (id order) whose first roll-up was seen; and how many more
    were excess but deferred by the cap. Phase-2 victims are not excess again.

    A cached cluster's configured count is fixed while it stays cached, so its drains are keyed on
    the grace and cap fraction alone; most clusters cost two dict lookups here.
    """
    victims_by_cluster: dict[str, set[str]] = {}
    for a in preempts:
        if isinstance(a, Drain):
            victims_by_cluster.setdefault(a.cluster_id, set()).add(a.machine_id)
    grace, frac = config.reclaim_grace_seconds, config.reclaim_cap_fraction
    first, counts = state.first_rollup, cy.ix.configured_count
    reclaims: list[Action] = []
    deferred = 0
    no_victims: set[str] = set()
    for c in sorted(counts):
        if c not in first:
            continue
        excl = victims_by_cluster.get(c, no_victims)
        memo = memos.get(c)
        if memo is not None and not excl and c in needs_of:
            dr = memo.drains
            if dr is None or dr[0] != (grace, frac):
                d_list, d_total = excess_drains(cy, c, grace, reclaim_cap(counts[c], frac), excl, memo)
                dr = memo.drains = ((grace, frac), d_list, d_total)
            drains, total = dr[1], dr[2]
        else:
            drains, total = excess_drains(cy, c, grace, reclaim_cap(counts[c], frac), excl)
        if total:
            reclaims.extend(drains)
            deferred += total - len(drains)
    return reclaims, deferred
