"""Phase 1, Same domain: one domain per gang per cycle, over creditable and acquirable supply.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from bigfleet.machine.record import Machine

from .credit import bound_lists, credit_reserved, hold, keep_stream
from .index import (
    CONFIGURED,
    CONFIGURING,
    IDLE,
    SPEC,
    MClass,
)
from .scratch import CycleScratch, NeedRow
from .vec import Vec, covers, units_to_cover, vadd, vsub


class DomainBucket:
    __slots__ = ("count", "cred", "cred_own", "members", "total", "value")

    def __init__(self, value: str, zero: Vec) -> None:
        self.value = value
        self.count = 0
        self.total = zero
        self.cred = zero
        self.cred_own = zero
        self.members: list[tuple[MClass, Machine, bool]] = []


def _score(total: Vec, deficit: Vec, capped: bool) -> float:
    s = 0.0
    for t, d in zip(total, deficit, strict=False):
        if d > 0:
            r = t / d
            s += min(r, 1.0) if capped else r
    return s


def choose_same_bucket(buckets: Iterable[DomainBucket], deficit: Vec) -> DomainBucket | None:
    """The documented total order over candidate domains (decision-engine.md §8.3)."""
    best: DomainBucket | None = None
    best_k: tuple[Any, ...] = ()
    for b in buckets:
        if b.count == 0:
            continue
        sat = covers(b.total, deficit)
        score = _score(b.total, deficit, not sat)
        cred = _score(b.cred, deficit, True) if any(b.cred) else 0.0
        own = _score(b.cred_own, deficit, True) if any(b.cred_own) else 0.0
        # smaller tuple wins
        if sat:
            k: tuple[Any, ...] = (0, -cred, -own, score, 0.0, -b.count, b.value)
        else:
            k = (1, 0.0, 0.0, -score, -cred, -b.count, b.value)
        if best is None or k < best_k:
            best, best_k = b, k
    return best


def credit_same(cy: CycleScratch, n: NeedRow, sticky: str | None) -> None:
    same = n.same
    assert same is not None
    key = same.key
    buckets: dict[str, DomainBucket] = {}
    zero = cy.zero
    alloc = cy.alloc
    for state in (CONFIGURED, CONFIGURING):
        for c, m in keep_stream(cy, n, state, bound_lists(cy, n, state)):
            v = c.attrs.get(key)
            if v is None:
                continue
            b = buckets.get(v)
            if b is None:
                b = buckets[v] = DomainBucket(v, zero)
            a = alloc[c.idx]
            own = m.assignment.need_fingerprint == n.fp and m.assignment.group == n.group
            b.count += 1
            b.total = vadd(b.total, a)
            b.cred = vadd(b.cred, a)
            if own:
                b.cred_own = vadd(b.cred_own, a)
            b.members.append((c, m, own))
    _count_creating(cy, n, key, buckets)
    if not n.parked:
        for v, classes in cy.domains(n, key):
            count, total = _domain_free(cy, classes)
            if total is None:
                continue
            b = buckets.get(v)
            if b is None:
                b = buckets[v] = DomainBucket(v, zero)
            b.count += count
            b.total = vadd(b.total, total)
    if not buckets:
        return
    best: DomainBucket | None = None
    if sticky is not None and sticky in buckets and covers(buckets[sticky].total, n.remaining):
        best = buckets[sticky]
    if best is None:
        best = choose_same_bucket((buckets[v] for v in sorted(buckets)), n.remaining)
    if best is None:
        return
    n.same_domain = best.value
    n.same_sat = covers(best.total, n.remaining)
    ordered = [t for t in best.members if t[2]] + [t for t in best.members if not t[2]]
    for c, m, _own in ordered:
        if not any(n.remaining):
            break
        hold(cy, m, n)
        n.remaining = vsub(n.remaining, alloc[c.idx])
    if any(n.remaining):
        credit_reserved(cy, n, best.value)
    if any(n.remaining) and not n.parked:
        # Virtually reserve the chosen domain's free supply so needs ranked later see what is left.
        rem = n.remaining
        dom_classes = next((cl for v, cl in cy.domains(n, key) if v == best.value), [])
        for state in (IDLE, SPEC):
            for c in dom_classes:
                k = (state, c.idx)
                avail = cy.available(k)
                a = alloc[c.idx]
                used = units_to_cover(rem, a, avail)
                if used:
                    rem = vsub(rem, tuple([x * used for x in a]))
                    cy.vused[k] = cy.vused.get(k, 0) + used
                    cy.pool_ver[c.idx] = cy.pool_ver.get(c.idx, 0) + 1
                if not any(rem):
                    return


def _domain_free(cy: CycleScratch, classes: list[MClass]) -> tuple[int, Vec | None]:
    """Free (Idle + Speculative, not taken or virtually reserved) machines of a domain's classes and
    their total allocatable (None: none). Gangs of one shape rank the same domains one after the
    other, and between two of them only the chosen domain's pools change: the sums are memoised
    per domain and recomputed only when one of its classes' pool versions moved."""
    vers = tuple([cy.pool_ver.get(c.idx, 0) for c in classes])
    hit = cy.domain_free.get(id(classes))
    if hit is not None and hit[0] is classes and hit[1] == vers:
        return hit[2], hit[3]
    alloc = cy.alloc
    count = 0
    total: Vec | None = None
    for c in classes:
        for state in (IDLE, SPEC):
            avail = cy.available((state, c.idx))
            if avail > 0:
                count += avail
                a = tuple([x * avail for x in alloc[c.idx]])
                total = a if total is None else vadd(total, a)
    cy.domain_free[id(classes)] = (classes, vers, count, total)
    return count, total


def _count_creating(cy: CycleScratch, n: NeedRow, key: str, buckets: dict[str, DomainBucket]) -> None:
    """Count the machines being created for this gang in their domains' buckets, as credit.

    A Creating replacement for a lost member is supply the gang already owns: leaving it out made
    the sticky domain look short and moved the whole gang (a reprovision elsewhere, a reclaim of the
    members left behind). Reading them makes the cluster's result depend on in-flight creates, so
    the cluster is not cached (`reserved_credit`).
    """
    creating = cy.ix.creating.get(n.fp)
    if not creating:
        return
    eligible = cy.eligible_set(n)
    for m in creating:
        if m.id in cy.claim:
            continue
        owner = m.cluster or cy.reservations.get(m.id, "")
        if owner and owner != n.cluster:
            continue
        c = cy.ix.cls(m)
        v = c.attrs.get(key)
        if v is None or c.idx not in eligible:
            continue
        n.reserved_credit = True
        b = buckets.get(v)
        if b is None:
            b = buckets[v] = DomainBucket(v, cy.zero)
        a = cy.alloc[c.idx]
        b.count += 1
        b.total = vadd(b.total, a)
        b.cred = vadd(b.cred, a)
        b.cred_own = vadd(b.cred_own, a)
