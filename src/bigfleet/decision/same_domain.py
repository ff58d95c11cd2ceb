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


def _bucket_key(value: str, count: int, total: Vec, cred: Vec, own: Vec, deficit: Vec) -> tuple[Any, ...]:
    """A candidate domain's place in the documented total order (decision-engine.md §8.3): the
    smallest key wins (`value` last, so keys never tie)."""
    sat = covers(total, deficit)
    score = _score(total, deficit, not sat)
    c = _score(cred, deficit, True) if any(cred) else 0.0
    if sat:
        return (0, -c, -(_score(own, deficit, True) if any(own) else 0.0), score, 0.0, -count, value)
    return (1, 0.0, 0.0, -score, -c, -count, value)


def choose_same_bucket(buckets: Iterable[DomainBucket], deficit: Vec) -> DomainBucket | None:
    """The first domain in the documented total order (decision-engine.md §8.3)."""
    best: DomainBucket | None = None
    best_k: tuple[Any, ...] = ()
    for b in buckets:
        if b.count == 0:
            continue
        k = _bucket_key(b.value, b.count, b.total, b.cred, b.cred_own, deficit)
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
    deficit = n.remaining
    #: domains with free supply only: their key is memoised with the supply (`DomainFree`)
    free_only: dict[str, DomainFree] = {}
    if not n.parked:
        for v, classes in cy.domains(n, key):
            free = _domain_free(cy, classes)
            if free.total is None:
                continue
            b = buckets.get(v)
            if b is None:
                free_only[v] = free
            else:
                b.count += free.count
                b.total = vadd(b.total, free.total)
    if not buckets and not free_only:
        return
    best_value = _pick(buckets, free_only, deficit, sticky)
    if best_value is None:
        return
    best = buckets.get(best_value)
    if best is None:
        best = buckets[best_value] = _free_bucket(best_value, free_only[best_value])
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


class DomainFree:
    """A domain's free (Idle + Speculative, not taken or virtually reserved) machines as of its
    classes' pool versions, and its key as a free-only candidate per deficit (gangs of one shape
    rank the same domains with the same deficit one after the other)."""

    __slots__ = ("classes", "count", "keys", "total", "vers")

    def __init__(self, classes: list[MClass], vers: tuple[int, ...], count: int, total: Vec | None) -> None:
        self.classes = classes
        self.vers = vers
        self.count = count
        self.total = total
        self.keys: dict[Vec, tuple[Any, ...]] = {}

    def key(self, value: str, deficit: Vec, zero: Vec) -> tuple[Any, ...]:
        k = self.keys.get(deficit)
        if k is None:
            assert self.total is not None
            k = self.keys[deficit] = _bucket_key(value, self.count, self.total, zero, zero, deficit)
        return k


def _free_bucket(value: str, free: DomainFree) -> DomainBucket:
    assert free.total is not None
    b = DomainBucket(value, free.total)
    b.count = free.count
    b.cred = b.cred_own = tuple(0 for _ in free.total)
    return b


def _pick(buckets: dict[str, DomainBucket], free_only: dict[str, DomainFree], deficit: Vec,
          sticky: str | None) -> str | None:
    """The sticky domain while it still covers the deficit, else the first in the total order."""
    if sticky is not None:
        b = buckets.get(sticky)
        f = free_only.get(sticky) if b is None else None
        total = b.total if b is not None else f.total if f is not None else None
        if total is not None and covers(total, deficit):
            return sticky
    best: str | None = None
    best_k: tuple[Any, ...] = ()
    for v, b in buckets.items():
        if b.count:
            k = _bucket_key(v, b.count, b.total, b.cred, b.cred_own, deficit)
            if best is None or k < best_k:
                best, best_k = v, k
    zero = tuple(0 for _ in deficit)
    for v, f in free_only.items():
        k = f.key(v, deficit, zero)
        if best is None or k < best_k:
            best, best_k = v, k
    return best


def _domain_free(cy: CycleScratch, classes: list[MClass]) -> DomainFree:
    """Free machines of a domain's classes. Between two gangs ranking the same domains only the
    chosen domain's pools change: memoised per domain, recomputed when a class's pool version moved."""
    pool_ver = cy.pool_ver
    vers = (pool_ver.get(classes[0].idx, 0),) if len(classes) == 1 else tuple([pool_ver.get(c.idx, 0) for c in classes])
    hit = cy.domain_free.get(id(classes))
    if hit is not None and hit.classes is classes and hit.vers == vers:
        return hit
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
    got = cy.domain_free[id(classes)] = DomainFree(classes, vers, count, total)
    return got


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
