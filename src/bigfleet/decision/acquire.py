"""Phase 1, acquire: Idle before Speculative, cheapest effective cost first, strict spread round-robin.
"""

from __future__ import annotations

import heapq
from itertools import repeat
from operator import le

from bigfleet.machine.record import Machine
from bigfleet.needs.penalty import bucket_dollars

from .index import (
    IDLE,
    SPEC,
    MClass,
    m_reclamation,
)
from .records import build_each
from .scratch import MACHINE_ID, CycleScratch, NeedRow
from .types import REASON_IDLE, REASON_SPECULATIVE, Action, Configure, Create
from .vec import vsub


def ordered_classes(cy: CycleScratch, classes: list[MClass], state: int, penalty: float) -> list[list[MClass]]:
    """Classes with supply in `state`, grouped by equal effective cost, cheapest group first (cached)."""
    ck = (id(classes), state, penalty)  # class lists come from per-cycle caches: identity is stable
    hit = cy.ordered_groups.get(ck)
    if hit is not None and hit[0] is classes:
        return hit[1]
    got = _order_classes(cy, classes, state, penalty)
    cy.ordered_groups[ck] = (classes, got)
    return got


def _order_classes(cy: CycleScratch, classes: list[MClass], state: int, penalty: float) -> list[list[MClass]]:
    have = [c for c in classes if (state, c.idx) in cy.ix.pool]
    have.sort(key=lambda c: (c.eff_cost(penalty), c.idx))
    groups: list[list[MClass]] = []
    last = None
    for c in have:
        e = c.eff_cost(penalty)
        if groups and e == last:
            groups[-1].append(c)
        else:
            groups.append([c])
            last = e
    return groups


def next_in_group(cy: CycleScratch, state: int, group: list[MClass]) -> tuple[MClass, Machine] | None:
    """The next unclaimed machine of a group of equal-cost classes: reclamation asc, then id.

    Groups of several classes keep a lazily validated heap of class heads, so picking is
    O(log classes) instead of a scan of every class per pick.
    """
    if len(group) == 1:
        c = group[0]
        m = cy.head((state, c.idx))
        return None if m is None else (c, m)
    h = _group_heap(cy, state, group)
    classes = cy.ix.classes
    while h:
        _, mid, ci = h[0]
        m = cy.head((state, ci))
        if m is None:
            heapq.heappop(h)
            continue
        if m.id != mid:
            heapq.heapreplace(h, (m_reclamation(m), m.id, ci))
            continue
        return classes[ci], m
    return None


def _bulk_take(cy: CycleScratch, n: NeedRow, state: int, c: MClass) -> None:
    """Take from one class what covers the need, in pool order, in one sweep: the same machines
    the one-at-a-time loop picks (a class's pool list is already in pick order), without a
    function call and a vector per machine (reprovisioning places tens of thousands per cycle)."""
    key = (state, c.idx)
    lst = cy.ix.pool.get(key)
    if not lst:
        return
    a = cy.alloc[c.idx]
    k = min(cy.units(n.remaining, a), len(lst))
    if k <= 0:
        return
    claim = cy.claim
    i = cy.cursor.get(key, 0)
    size = len(lst)
    got = lst[i:i + k]
    ids = list(map(MACHINE_ID, got))
    if any(map(claim.__contains__, ids)):  # some already claimed (reservations): walk and skip them
        got = []
        while i < size and len(got) < k:
            m = lst[i]
            if m.id not in claim:
                got.append(m)
            i += 1
        ids = list(map(MACHINE_ID, got))
    else:
        i += len(got)
    cy.cursor[key] = i
    if not got:
        return
    claim.update(zip(ids, repeat(n)))
    n.claimed.extend(got)
    cy.taken[key] = cy.taken.get(key, 0) + len(got)
    cy.pool_ver[c.idx] = cy.pool_ver.get(c.idx, 0) + 1
    (n.acquired_idle if state == IDLE else n.acquired_spec).extend(got)
    taken = len(got)
    n.remaining = vsub(n.remaining, tuple([x * taken for x in a]))


#: a need's acquisition order: (state, group of equal-cost classes), Idle groups before Speculative
Plan = list[tuple[int, list[MClass]]]


def acquire_plan(cy: CycleScratch, classes: list[MClass], penalty: float) -> Plan:
    """The groups `acquire` walks, in order (static within a cycle: the pools' keys do not change)."""
    return [(state, g) for state in (IDLE, SPEC) for g in ordered_classes(cy, classes, state, penalty)]


def take_plan(cy: CycleScratch, n: NeedRow, plan: Plan) -> None:
    """Idle then Speculative, cheapest group first, until the need is covered."""
    take_plan_rows(cy, [n], plan)


def take_plan_rows(cy: CycleScratch, rows: list[NeedRow], plan: Plan) -> None:
    """`take_plan` for consecutive rows sharing one plan, group by group. The plan's pools are
    disjoint, so each pool is taken from by the same rows in the same order as row by row (a row
    reaches a group only while uncovered), and each group's set-up is paid once per run, not per row."""
    left = rows
    last = len(plan) - 1
    for step, (state, group) in enumerate(plan):
        if len(group) == 1:
            c = group[0]
            for n in left:
                _bulk_take(cy, n, state, c)
        else:
            _group_take(cy, left, state, group)
        if step < last:
            left = [n for n in left if any(n.remaining)]
            if not left:
                return


def _group_heap(cy: CycleScratch, state: int, group: list[MClass]) -> list[tuple[float, str, int]]:
    """The group's heap of class heads (reclamation, id, class idx), built once per cycle. An entry may
    be stale (its machine claimed since): it never sorts after its class's real head, and is
    re-validated when it reaches the top."""
    gk = (state, id(group))
    hit = cy.group_heaps.get(gk)
    if hit is not None and hit[0] is group:
        return hit[1]
    h = []
    for c in group:
        m = cy.head((state, c.idx))
        if m is not None:
            h.append((m_reclamation(m), m.id, c.idx))
    heapq.heapify(h)
    cy.group_heaps[gk] = (group, h)
    return h


def _group_take(cy: CycleScratch, rows: list[NeedRow], state: int, group: list[MClass]) -> None:
    """Pick one machine at a time from a group of equal-cost classes in (reclamation, id) order, for
    each row (all uncovered) in turn until it is covered: `next_in_group` and `CycleScratch.take` inlined
    (realistic-50k picks ~50 000 machines this way, one per need), moving the picked class's heap
    entry on to its next machine at once."""
    h = _group_heap(cy, state, group)
    pool, cursor, claim, taken, pool_ver, alloc = cy.ix.pool, cy.cursor, cy.claim, cy.taken, cy.pool_ver, cy.alloc
    zero, idle = cy.zero, state == IDLE
    for n in rows:
        if not h:
            return
        rem = n.remaining
        got = n.acquired_idle if idle else n.acquired_spec
        claimed = n.claimed
        while h:
            _, mid, ci = h[0]
            key = (state, ci)
            lst = pool[key]
            size = len(lst)
            i = cursor.get(key, 0)
            while i < size and lst[i].id in claim:
                i += 1
            if i >= size:
                cursor[key] = i
                heapq.heappop(h)
                continue
            m = lst[i]
            if m.id != mid:
                cursor[key] = i
                heapq.heapreplace(h, (m_reclamation(m), m.id, ci))
                continue
            claim[mid] = n
            claimed.append(m)
            got.append(m)
            taken[key] = taken.get(key, 0) + 1
            pool_ver[ci] = pool_ver.get(ci, 0) + 1
            i += 1
            cursor[key] = i
            if i < size:
                nxt = lst[i]
                r = nxt.assignment.reclamation_penalty_dollars  # (`m_reclamation` inlined)
                heapq.heapreplace(h, (0.0 if r != r or r < 0 else r, nxt.id, ci))
            else:
                heapq.heappop(h)
            a = alloc[ci]
            if all(map(le, rem, a)):  # the machine covers what was left (a single-machine need): no vector to build
                rem = zero
                break
            rem = vsub(rem, a)
        n.remaining = rem


def acquire_spread(cy: CycleScratch, n: NeedRow, classes: list[MClass], penalty: float) -> None:
    """Acquire one machine at a time, each from the cheapest domain combination that keeps every
    strict spread term within its skew (a class's domain is its tuple of values, one per term)."""
    terms = n.spreads
    keys = [t.topology_key for t in terms]
    skews = [max(1, int(t.max_skew)) for t in terms]
    counts: list[dict[str, int]] = [{} for _ in terms]
    for m in n.claimed:
        attrs = cy.ix.cls(m).attrs
        for i, key in enumerate(keys):
            v = attrs.get(key)
            if v is not None:
                counts[i][v] = counts[i].get(v, 0) + 1
    for state in (IDLE, SPEC):
        by_dom: dict[tuple[str, ...], list[MClass]] = {}
        for c in classes:
            if (state, c.idx) not in cy.ix.pool:
                continue
            values = [c.attrs.get(key) for key in keys]
            if None not in values:  # a class without some term's key is no domain of that term
                by_dom.setdefault(tuple([v for v in values if v is not None]), []).append(c)
        for dom in by_dom:
            for i, v in enumerate(dom):
                counts[i].setdefault(v, 0)
        groups = {dom: ordered_classes(cy, cl, state, penalty) for dom, cl in sorted(by_dom.items())}
        while any(n.remaining) and groups:
            pick = _spread_pick(cy, state, groups, counts, skews, penalty)
            if pick is None:
                break
            dom, c, m = pick
            cy.take(m, n, (state, c.idx))
            (n.acquired_idle if state == IDLE else n.acquired_spec).append(m)
            n.remaining = vsub(n.remaining, cy.alloc[c.idx])
            for i, v in enumerate(dom):
                counts[i][v] += 1


def _spread_pick(cy: CycleScratch, state: int, groups: dict[tuple[str, ...], list[list[MClass]]],
                 counts: list[dict[str, int]], skews: list[int], penalty: float
                 ) -> tuple[tuple[str, ...], MClass, Machine] | None:
    """The cheapest next machine (then the smallest domain tuple) whose every domain is within skew."""
    ceilings = [min(cnt.values()) + skew - 1 for cnt, skew in zip(counts, skews, strict=True)]
    best: tuple[float, tuple[str, ...], MClass, Machine] | None = None
    for dom, dom_groups in groups.items():
        if any(counts[i][v] > ceilings[i] for i, v in enumerate(dom)):
            continue
        for g in dom_groups:
            nxt = next_in_group(cy, state, g)
            if nxt is not None:
                cost = nxt[0].eff_cost(penalty)
                if best is None or (cost, dom) < (best[0], best[1]):
                    best = (cost, dom, nxt[0], nxt[1])
                break
    return None if best is None else (best[1], best[2], best[3])


def acquisition_actions(rows: list[NeedRow]) -> list[Action]:
    """Phase-1 actions: per need in precedence order, its Configures (Idle) then Creates (Speculative)."""
    out: list[Action] = []
    for n in rows:
        if not n.acquired_idle and not n.acquired_spec:
            continue
        common = {"machine_id": "", "cluster_id": n.cluster, "need_fingerprint": n.fp, "priority": n.prio,
                  "interruption_penalty_dollars": bucket_dollars(n.ib),
                  "reclamation_penalty_dollars": bucket_dollars(n.rb), "requirements": n.reqs, "group": n.group}
        if n.acquired_idle:
            build_each(Configure, n.acquired_idle, {**common, "reason": REASON_IDLE, "kind": "configure"}, out)
        if n.acquired_spec:
            build_each(Create, n.acquired_spec, {**common, "reason": REASON_SPECULATIVE, "kind": "create"}, out)
    return out
