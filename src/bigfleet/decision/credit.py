"""Phase 1, credit: a need keeps its own cluster's bound machines (and in-flight reservations).

Bound machines are walked in keep order (price asc, reclamation desc, class, id); long runs of
equal machines are credited in bulk (one slice and one C-level dict update per run).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from itertools import repeat
from math import isnan
from operator import itemgetter

from bigfleet.machine.record import Machine

from .index import (
    CONFIGURED,
    CONFIGURING,
    IDLE,
    MClass,
    m_reclamation,
)
from .scratch import CONFIGURED_STATE, MACHINE_ID, RECLAMATION_STAMP, CycleScratch, NeedRow
from .vec import Vec, covers, units_to_cover, vsub


def bound_lists(cy: CycleScratch, n: NeedRow, state: int) -> list[tuple[MClass, list[Machine]]]:
    """The cluster's bound lists in `state` of the need's eligible classes, by (price, class idx):
    one C-level set intersection and a sort by a per-cycle class rank (memoised per requirements)."""
    by_class = cy.ix.bound.get(n.cluster, {}).get(state)
    if not by_class:
        return []
    k = (n.cluster, state, n.reqs, n.minu)
    got = cy.bound_lists_memo.get(k)
    if got is None:
        classes = cy.ix.classes
        common = sorted(cy.eligible_set(n).intersection(by_class), key=cy.price_rank().__getitem__)
        got = [(classes[ci], by_class[ci]) for ci in common]
        cy.bound_lists_memo[k] = got
    return got


def hold(cy: CycleScratch, m: Machine, n: NeedRow) -> None:
    h = cy.held.get(n.cluster)
    if h is None:
        h = cy.held[n.cluster] = {}
    h[m.id] = n
    n.claimed.append(m)
    n.credited += 1
    if m.state is CONFIGURED_STATE:
        cy.hconf[n.cluster] = cy.hconf.get(n.cluster, 0) + 1


def _band_hold(cy: CycleScratch, n: NeedRow, state: int, lists: list[tuple[MClass, list[Machine]]]) -> bool:
    """Credit in bulk. The keep order over several classes is precomputed once per cycle as a few
    "runs" (segments of equal price and reclamation penalty, class after class, neighbours of equal
    allocatable concatenated), so crediting a need is one slice and one C-level dict update per run.
    False: a run was not clean (the caller finishes machine by machine; nothing taken is undone)."""
    hit = cy.band_runs.get(id(lists))
    if hit is not None and hit[0] is lists:
        runs = hit[1]
    else:
        runs = _keep_runs(cy, lists)
        cy.band_runs[id(lists)] = (lists, runs)
    if runs is None:
        return False
    held = cy.held.get(n.cluster)
    if held is None:
        held = cy.held[n.cluster] = {}
    rcur = cy.rcur
    all_taken = 0
    clean = True
    for ri, (a, run) in enumerate(runs):
        if not any(n.remaining):
            break
        ck = (id(lists), ri)
        i = rcur.get(ck, 0)
        size = len(run)
        while i < size and run[i].id in held:
            i += 1
        rcur[ck] = i
        k = units_to_cover(n.remaining, a, size - i)
        if k <= 0:
            continue
        chunk = run[i:i + k]
        ids = list(map(MACHINE_ID, chunk))
        if any(map(held.__contains__, ids)):
            clean = False
            break
        held.update(zip(ids, repeat(n)))
        n.claimed.extend(chunk)
        n.credited += k
        rcur[ck] = i + k
        n.remaining = vsub(n.remaining, tuple([x * k for x in a]))
        all_taken += k
    if state == CONFIGURED and all_taken:
        cy.hconf[n.cluster] = cy.hconf.get(n.cluster, 0) + all_taken
    return clean


def _keep_runs(cy: CycleScratch, lists: list[tuple[MClass, list[Machine]]]) -> list[tuple[Vec, list[Machine]]]:
    """Split every class list into segments of equal reclamation penalty, order the segments by
    (price, reclamation desc, class), and concatenate neighbours of equal allocatable into runs.

    A class list is in keep order (reclamation desc, then id), so a segment ends where a binary
    search for its penalty says: O(penalties × log machines) per class, not a walk of every machine
    (a wave of drains changes every cluster, and this ran over the whole fleet each cycle).
    """
    segs: list[tuple[float, float, int, Vec, list[Machine], int, int]] = []
    rank = cy.class_rank()
    for c, lst in lists:
        a = cy.alloc[c.idx]
        cr = rank[c.idx]  # (class position in sort_key order: the same tie-break, int compares)
        if RECLAMATION_STAMP(lst[0]) == RECLAMATION_STAMP(lst[-1]):  # one penalty in the whole class (common)
            segs.append((c.price, -m_reclamation(lst[0]), cr, a, lst, 0, len(lst)))
            continue
        stamps = list(map(RECLAMATION_STAMP, lst))
        plain = not any(map(isnan, stamps)) and min(stamps) >= 0
        pos, size = 0, len(lst)
        while pos < size:
            r = m_reclamation(lst[pos])
            # stamps descend along a keep-ordered list: a plain one's run of r is all its copies (C count)
            end = pos + stamps.count(r) if plain else bisect_right(lst, -r, pos, size, key=_negated_reclamation)
            segs.append((c.price, -r, cr, a, lst, pos, end))
            pos = end
    segs.sort(key=_SEG_ORDER)
    runs: list[tuple[Vec, list[Machine]]] = []
    for _, _, _, a, lst, lo, hi in segs:
        if runs and runs[-1][0] == a:
            runs[-1][1].extend(lst[lo:hi])
        else:
            runs.append((a, lst[lo:hi]))
    return runs


_SEG_ORDER = itemgetter(0, 1, 2)


def _negated_reclamation(m: Machine) -> float:
    return -m_reclamation(m)


def _bulk_hold(cy: CycleScratch, n: NeedRow, state: int, c: MClass, lst: list[Machine]) -> bool:
    """Credit a whole run of one class at once (C-level dict update); False if the run is not clean."""
    held = cy.held.get(n.cluster)
    if held is None:
        held = cy.held[n.cluster] = {}
    ck = (n.cluster, state, c.idx)
    i = cy.bcur.get(ck, 0)
    size = len(lst)
    while i < size and lst[i].id in held:
        i += 1
    cy.bcur[ck] = i
    a = cy.alloc[c.idx]
    k = units_to_cover(n.remaining, a, size - i)
    if k <= 0:
        return size - i == 0
    chunk = lst[i:i + k]
    ids = list(map(MACHINE_ID, chunk))
    if any(map(held.__contains__, ids)):
        return False
    held.update(zip(ids, repeat(n)))
    n.claimed.extend(chunk)
    n.credited += k
    n.remaining = vsub(n.remaining, tuple([x * k for x in a]))
    cy.bcur[ck] = i + k
    if state == CONFIGURED:
        cy.hconf[n.cluster] = cy.hconf.get(n.cluster, 0) + k
    return True


def keep_stream(cy: CycleScratch, n: NeedRow, state: int, lists: list[tuple[MClass, list[Machine]]]
                 ) -> Iterable[tuple[MClass, Machine]]:
    """Bound machines in keep order: price asc, reclamation desc, id asc; held ones skipped."""
    claim = cy.held.get(n.cluster)
    if claim is None:
        claim = cy.held[n.cluster] = {}
    if len(lists) == 1:
        c, lst = lists[0]
        ck = (n.cluster, state, c.idx)
        i = cy.bcur.get(ck, 0)
        size = len(lst)
        while i < size and lst[i].id in claim:
            i += 1
        cy.bcur[ck] = i
        while i < size:
            m = lst[i]
            if m.id not in claim:
                yield c, m
            i += 1
        return
    # keep order across classes: price asc, reclamation desc, then class, then id (a class's run of
    # equal-value machines stays contiguous, which is what lets `credit_plain` credit it in bulk)
    # The merged order of a given set of lists is computed once per cycle and walked with a cursor.
    mk = id(lists)
    hit = cy.merged_keep_order.get(mk)
    if hit is not None and hit[0] is lists:
        got = hit[1]
    else:
        items = [(c.price, -m_reclamation(m), c.sort_key, m.id, c, m) for c, lst in lists for m in lst]
        items.sort(key=lambda t: (t[0], t[1], t[2], t[3]))
        got = [(it[4], it[5]) for it in items]  # not `t`: mypyc shares a generator's comprehension vars with its locals
        cy.merged_keep_order[mk] = (lists, got)
        cy.mcur.pop(mk, None)
    i = cy.mcur.get(mk, 0)
    size = len(got)
    while i < size and got[i][1].id in claim:
        i += 1
    cy.mcur[mk] = i
    while i < size:
        t = got[i]
        if t[1].id not in claim:
            yield t
        i += 1


def credit_plain(cy: CycleScratch, n: NeedRow) -> None:
    for state in (CONFIGURED, CONFIGURING):
        if not any(n.remaining):
            return
        lists = bound_lists(cy, n, state)
        if not lists:  # nothing bound here (every need of a bootstrapping cluster): no stream to set up
            continue
        if len(lists) == 1:
            if _bulk_hold(cy, n, state, lists[0][0], lists[0][1]):
                continue
        elif _band_hold(cy, n, state, lists):
            continue
        for c, m in keep_stream(cy, n, state, lists):
            if not any(n.remaining):
                return
            hold(cy, m, n)
            n.remaining = vsub(n.remaining, cy.alloc[c.idx])
    if any(n.remaining):
        credit_reserved(cy, n)


def credit_reserved(cy: CycleScratch, n: NeedRow, domain: str | None = None) -> None:
    """Credit machines the shard launched or is configuring for exactly this need (by attribution)."""
    ix = cy.ix
    k = n.fp
    for lst, pooled in ((ix.creating.get(k), False), (ix.reserved_idle.get(k), True)):
        if not lst:
            continue
        for m in lst:
            if not any(n.remaining):
                return
            if m.id in cy.claim:
                continue
            owner = m.cluster or cy.reservations.get(m.id, "")
            if owner and owner != n.cluster:
                continue
            c = ix.cls(m)
            if not covers(cy.alloc[c.idx], n.minu) or not all(r.matches(c.attrs) for r in n.reqs):
                continue
            if domain is not None and n.same is not None and c.attrs.get(n.same.key) != domain:
                continue
            n.reserved_credit = True
            if pooled:
                cy.take(m, n, (IDLE, c.idx))
                n.acquired_idle.append(m)
            else:
                cy.take(m, n, None)
                n.credited += 1
            n.remaining = vsub(n.remaining, cy.alloc[c.idx])
