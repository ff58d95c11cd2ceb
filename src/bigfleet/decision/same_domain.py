"""Phase 1, Same domain: one domain per gang per cycle, over creditable and acquirable supply.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from itertools import compress, repeat
from operator import ne
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
from .vec import Vec, covers, vadd, vsub


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
    got = _first_bucket(buckets, deficit)
    return got[1] if got is not None else None


def _first_bucket(buckets: Iterable[DomainBucket], deficit: Vec) -> tuple[tuple[Any, ...], DomainBucket] | None:
    """The first non-empty bucket in the total order, with its key."""
    best: tuple[tuple[Any, ...], DomainBucket] | None = None
    for b in buckets:
        if b.count:
            k = _bucket_key(b.value, b.count, b.total, b.cred, b.cred_own, deficit)
            if best is None or k < best[0]:
                best = (k, b)
    return best


def credit_same(cy: CycleScratch, n: NeedRow, sticky: str | None) -> None:
    """Choose the gang's domain for this cycle, hold its bound machines there and virtually reserve
    that domain's free supply for what is still short (needs ranked later see what is left)."""
    same = n.same
    assert same is not None
    key = same.key
    buckets = _bound_buckets(cy, n, key)
    _count_creating(cy, n, key, buckets)
    deficit = n.remaining
    ranking = None if n.parked else _ranking(cy, n, key, deficit)
    free = ranking.frees if ranking is not None else {}
    for v, b in buckets.items():
        f = free.get(v)
        if f is not None:
            assert f.total is not None
            b.count += f.count
            b.total = vadd(b.total, f.total)
    best = _pick(buckets, ranking, deficit, sticky)
    if best is None:
        return
    n.same_domain = best
    chosen = buckets.get(best)
    if chosen is None:  # free supply only
        total = free[best].total
        assert total is not None
        n.same_sat = covers(total, deficit)
    else:
        n.same_sat = covers(chosen.total, deficit)
        _hold_members(cy, n, chosen.members)
    if any(n.remaining):
        credit_reserved(cy, n, best)
    f = free.get(best)
    if any(n.remaining) and f is not None:  # (no free supply when ranked: none now, crediting only takes)
        _reserve_free(cy, n.remaining, f.classes)


def _bound_buckets(cy: CycleScratch, n: NeedRow, key: str) -> dict[str, DomainBucket]:
    """The cluster's unheld bound machines of the gang's classes by domain, as credit (its own
    first when held). Totals are summed per class once, not a vector add per machine."""
    buckets: dict[str, DomainBucket] = {}
    tally: dict[tuple[str, int], list[int]] = {}  # (domain, class) → [machines, the gang's own]
    fp, group = n.fp, n.group
    for state in (CONFIGURED, CONFIGURING):
        for c, m in keep_stream(cy, n, state, bound_lists(cy, n, state)):
            v = c.attrs.get(key)
            if v is None:
                continue
            b = buckets.get(v)
            if b is None:
                b = buckets[v] = DomainBucket(v, cy.zero)
            asg = m.assignment
            own = asg.need_fingerprint == fp and asg.group == group
            t = tally.get((v, c.idx))
            if t is None:
                t = tally[(v, c.idx)] = [0, 0]
            t[0] += 1
            t[1] += own
            b.members.append((c, m, own))
    alloc = cy.alloc
    for (v, ci), (k, own_k) in tally.items():
        b = buckets[v]
        a = alloc[ci]
        b.count += k
        add = tuple([x * k for x in a])
        b.total = vadd(b.total, add)
        b.cred = vadd(b.cred, add)
        if own_k:
            b.cred_own = vadd(b.cred_own, tuple([x * own_k for x in a]))
    return buckets


def _hold_members(cy: CycleScratch, n: NeedRow, members: list[tuple[MClass, Machine, bool]]) -> None:
    """Hold the chosen domain's bound machines, the gang's own first, while it is short."""
    alloc = cy.alloc
    for c, m, _own in [t for t in members if t[2]] + [t for t in members if not t[2]]:
        if not any(n.remaining):
            return
        hold(cy, m, n)
        n.remaining = vsub(n.remaining, alloc[c.idx])


def _reserve_free(cy: CycleScratch, rem: Vec, classes: list[MClass]) -> None:
    """Virtually reserve a domain's free supply for `rem` (Idle first, then Speculative)."""
    alloc = cy.alloc
    for state in (IDLE, SPEC):
        for c in classes:
            k = (state, c.idx)
            avail = cy.available(k)
            if avail <= 0:
                continue
            a = alloc[c.idx]
            used = min(cy.units(rem, a), avail)
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


class FreeRanking:
    """The domains of one eligible class list with free supply, and their keys as free-only
    candidates for one deficit in order, refreshed where a class's pool version moved: between two
    gangs of one shape, usually the one domain the first chose."""

    __slots__ = ("deficit", "dom_at", "domains", "frees", "idxs", "keys", "order", "vers")

    def __init__(self, domains: list[tuple[str, list[MClass]]], deficit: Vec) -> None:
        self.domains = domains
        self.deficit = deficit
        #: the domains' classes, flattened, and each one's domain (by position in `domains`)
        self.idxs = [c.idx for _v, classes in domains for c in classes]
        self.dom_at = [i for i, (_v, classes) in enumerate(domains) for _c in classes]
        self.vers: tuple[int, ...] | None = None
        self.frees: dict[str, DomainFree] = {}
        self.keys: dict[str, tuple[Any, ...]] = {}
        self.order: list[tuple[Any, ...]] = []

    def refresh(self, cy: CycleScratch) -> None:
        vers = tuple(map(cy.pool_ver.get, self.idxs, repeat(0)))
        old = self.vers
        if vers == old:
            return
        self.vers = vers
        # (`dom_at` ascends: the domains whose classes moved, in order, each once)
        moved = range(len(self.domains)) if old is None else dict.fromkeys(compress(self.dom_at, map(ne, old, vers)))
        frees, keys, order, zero = self.frees, self.keys, self.order, cy.zero
        for i in moved:
            v, classes = self.domains[i]
            free = _domain_free(cy, classes)
            was = keys.pop(v, None)
            if was is not None:  # (keys never tie: each ends with its domain)
                del order[bisect_left(order, was)]
            if free.total is None:
                frees.pop(v, None)
            else:
                frees[v] = free
                k = keys[v] = free.key(v, self.deficit, zero)
                insort(order, k)


def _ranking(cy: CycleScratch, n: NeedRow, key: str, deficit: Vec) -> FreeRanking:
    domains = cy.domains(n, key)
    k = (id(domains), deficit)  # (the domain list lives as long as the scratch: its id is stable)
    got = cy.free_rankings.get(k)
    if got is None:
        got = cy.free_rankings[k] = FreeRanking(domains, deficit)
    got.refresh(cy)
    return got


def _pick(buckets: dict[str, DomainBucket], ranking: FreeRanking | None, deficit: Vec,
          sticky: str | None) -> str | None:
    """The sticky domain while it still covers the deficit, else the first in the total order:
    the best of the domains with bound machines against the first free-only one."""
    frees = ranking.frees if ranking is not None else {}
    if sticky is not None:
        b = buckets.get(sticky)
        f = frees.get(sticky) if b is None else None
        total = b.total if b is not None else f.total if f is not None else None
        if total is not None and covers(total, deficit):
            return sticky
    bound = _first_bucket(buckets.values(), deficit)
    if ranking is not None:
        for k in ranking.order:
            if k[-1] not in buckets:  # the first free-only domain
                if bound is None or k < bound[0]:
                    return str(k[-1])
                break
    return bound[1].value if bound is not None else None


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
