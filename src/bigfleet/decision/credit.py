"""Phase 1, credit: a need keeps its own cluster's bound machines (and in-flight reservations).

Bound machines are walked in keep order (price asc, reclamation desc, class, id); long runs of
equal machines are credited in bulk (one slice and one C-level dict update per run).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from itertools import accumulate, chain, groupby, repeat
from math import isnan
from operator import itemgetter, neg
from typing import cast

from bigfleet.machine.record import Machine

from .index import (
    CONFIGURED,
    CONFIGURING,
    IDLE,
    MClass,
    m_reclamation,
)
from .scratch import CONFIGURED_STATE, MACHINE_ID, RECLAMATION_STAMP, CycleScratch, NeedRow
from .vec import Vec, covers, vsub


def bound_lists(cy: CycleScratch, n: NeedRow, state: int) -> list[tuple[MClass, list[Machine]]]:
    """The cluster's bound lists in `state` of the need's eligible classes, by (price, class idx):
    one C-level set intersection and a sort by a per-cycle class rank (memoised per requirements)."""
    by_class = cy.ix.bound.get(n.cluster, {}).get(state)
    if not by_class:
        return []
    eligible = cy.eligible(n)
    k = (n.cluster, state, id(eligible))  # (the eligible list lives as long as the scratch: its id is stable)
    got = cy.bound_lists_memo.get(k)
    if got is None:
        classes = cy.ix.classes
        common = sorted(cy.eligible_set(n).intersection(by_class), key=cy.price_rank().__getitem__)
        got = [(classes[ci], by_class[ci]) for ci in common]
        cy.bound_lists_memo[k] = got
    return got


def hold(cy: CycleScratch, m: Machine, n: NeedRow) -> None:
    cy.held_in(n.cluster).ids()[m.id] = n
    n.claimed.append(m)
    n.credited += 1
    if m.state is CONFIGURED_STATE:
        cy.hconf[n.cluster] = cy.hconf.get(n.cluster, 0) + 1
        n.conf_credited += 1


class _Run:
    """Bound machines of equal allocatable in keep order, `ms[cur:end]`, with their ids (read while
    the machines are still in cache); every machine before `cur` is held."""

    __slots__ = ("alloc", "cur", "end", "ids", "ms")

    def __init__(self, alloc: Vec, ms: list[Machine], ids: list[str] | None = None, lo: int = 0,
                 hi: int | None = None) -> None:
        self.alloc = alloc
        self.ms = ms
        self.ids = list(map(MACHINE_ID, ms)) if ids is None else ids
        self.cur = lo
        self.end = len(ms) if hi is None else hi


class _ClusterKeep:
    """A cluster's bound classes of one state in keep order (each has one plain stamp), their
    machines concatenated in that order with their ids, and where each class starts: a need whose
    eligible classes are neighbours in that order (same type, same price) takes a view, not a copy."""

    __slots__ = ("ids", "ms", "offs", "order", "pos")

    def __init__(self, order: list[int], by_class: dict[int, list[Machine]]) -> None:
        self.order = order
        lsts = list(map(by_class.__getitem__, order))
        self.ms = list(chain.from_iterable(lsts))
        self.ids = list(map(MACHINE_ID, self.ms))
        self.offs = list(accumulate(map(len, lsts), initial=0))
        self.pos = dict(zip(order, range(len(order)), strict=True))


#: per bound state with matching machines: (state, its keep-order runs)
_Plan = list[tuple[int, list[_Run]]]


def _plans(cy: CycleScratch, n: NeedRow, bound: dict[int, dict[int, list[Machine]]]) -> _Plan:
    """The need's runs per bound state, shared by every need of the cluster with the same eligible
    classes (memoised per cycle). The eligible set is looked up by fingerprint: it is content-addressed
    over the requirements, so no per-need hash of the requirement tuple is needed."""
    hit = cy.fp_eligible.get(n.fp)
    if hit is not None and hit[0] == n.minu:
        tok = hit[1]
    else:
        tok = cy.eligible_set(n)
        cy.fp_eligible[n.fp] = (n.minu, tok)
    key = (n.cluster, id(tok))  # the set lives in the scratch's eligibility memo: its id is stable
    plan = cy.credit_plans.get(key)
    if plan is None:
        plan = []
        for state in (CONFIGURED, CONFIGURING):
            by_class = bound.get(state)
            if by_class:
                runs = _state_runs(cy, n, state, by_class, tok)
                if runs:
                    plan.append((state, runs))
        cy.credit_plans[key] = plan
    return plan


def _state_runs(cy: CycleScratch, n: NeedRow, state: int, by_class: dict[int, list[Machine]], tok: set[int]
                ) -> list[_Run]:
    """The runs of `_keep_runs` over the eligible classes: the cluster's classes in keep order (one
    sort per cluster and state), filtered at C level; `_keep_runs` itself when some class of the
    cluster has more than one reclamation stamp."""
    ck = (n.cluster, state)
    if ck in cy.keep_orders:
        keep = cy.keep_orders[ck]
    else:
        order = _class_keep_order(cy, by_class)
        keep = cy.keep_orders[ck] = _ClusterKeep(order, by_class) if order else None
    if keep is None:
        if tok.isdisjoint(by_class):
            return []
        return [_Run(a, ms) for a, ms in _mixed_stamp_runs(cy, by_class, tok)
                or _keep_runs(cy, bound_lists(cy, n, state))]
    order = keep.order
    common = tok.intersection(by_class)
    if not common:
        return []
    sel = sorted(common, key=keep.pos.__getitem__)
    alloc = cy.alloc
    groups = list(map(cy.alloc_group().__getitem__, sel))
    if groups.count(groups[0]) == len(groups):  # one allocatable (common): one run
        p0 = keep.pos[sel[0]]
        if order[p0:p0 + len(sel)] == sel:  # neighbours in the cluster's order: a view
            return [_Run(alloc[sel[0]], keep.ms, keep.ids, keep.offs[p0], keep.offs[p0 + len(sel)])]
        return [_Run(alloc[sel[0]], list(chain.from_iterable(map(by_class.__getitem__, sel))))]
    return [_Run(a, list(chain.from_iterable(map(by_class.__getitem__, map(_SECOND, grp)))))
            for a, grp in groupby(zip(map(alloc.__getitem__, sel), sel, strict=True), key=_FIRST)]


def _mixed_stamp_runs(cy: CycleScratch, by_class: dict[int, list[Machine]], tok: set[int]
                      ) -> list[tuple[Vec, list[Machine]]]:
    """`_keep_runs` for eligible classes of one allocatable and one price whose stamps differ: the
    lists concatenated in class-rank order, then one stable C-level sort by stamp (desc; `reverse`
    keeps equal stamps in their order) gives (reclamation desc, class, keep order within the class),
    i.e. the segments' order, without a Python step per segment. [] when that does not apply (odd
    stamps, several prices or sizes). The run's ids are the caller's to read, if it needs them."""
    sel = sorted(tok.intersection(by_class), key=cy.keep_rank().__getitem__)
    groups = list(map(cy.alloc_group().__getitem__, sel))
    prices = cy.class_prices()
    if groups.count(groups[0]) != len(groups) or len(set(map(prices.__getitem__, sel))) != 1:
        return []
    ms = list(chain.from_iterable(map(by_class.__getitem__, sel)))
    stamps = list(map(RECLAMATION_STAMP, ms))
    if any(map(isnan, stamps)) or min(stamps) < 0:
        return []
    ms.sort(key=RECLAMATION_STAMP, reverse=True)
    return [(cy.alloc[sel[0]], ms)]


def _class_keep_order(cy: CycleScratch, by_class: dict[int, list[Machine]]) -> list[int]:
    """The classes by (price, reclamation desc, class rank) when every class list has one plain
    reclamation stamp (then a class is one segment of `_keep_runs`); [] otherwise. C-level passes."""
    cis = list(by_class)
    lsts = list(by_class.values())
    firsts = list(map(RECLAMATION_STAMP, map(_FIRST, lsts)))
    if firsts != list(map(RECLAMATION_STAMP, map(_LAST, lsts))) or any(map(isnan, firsts)) or min(firsts) < 0:
        return []
    if firsts.count(firsts[0]) == len(firsts):  # one stamp in the whole cluster (common): an int sort
        return sorted(cis, key=cy.keep_rank().__getitem__)
    # ranks are unique, so the tuples never compare past them
    return list(map(_FOURTH, sorted(zip(map(cy.class_prices().__getitem__, cis), map(neg, firsts),
                                        map(cy.class_rank().__getitem__, cis), cis, strict=True))))


_FIRST = itemgetter(0)
_NO_STAMPS: dict[int, float] = {}
_SECOND = itemgetter(1)
_FOURTH = itemgetter(3)
_LAST = itemgetter(-1)


def _take_runs(cy: CycleScratch, n: NeedRow, state: int, runs: list[_Run]) -> bool:
    """Credit in bulk: one slice and one C-level dict update per run. False: a run was not clean
    (the caller finishes machine by machine; nothing taken is undone)."""
    held = cy.held_in(n.cluster).ids()
    rem = n.remaining
    all_taken = 0
    clean = True
    for r in runs:
        rids = r.ids
        i = r.cur
        size = r.end
        while i < size and rids[i] in held:
            i += 1
        r.cur = i
        a = r.alloc
        left = size - i
        k = 0  # units_to_cover, inlined: this runs once per need
        for x, u in zip(rem, a, strict=False):
            if x > 0:
                if u <= 0:
                    k = left
                    break
                q = -(-x // u)
                if q > k:
                    k = q
        if k > left:
            k = left
        if k <= 0:
            continue
        ids = rids[i:i + k]
        if not held.keys().isdisjoint(ids):
            clean = False
            break
        held.update(zip(ids, repeat(n)))
        n.claimed.extend(r.ms[i:i + k])
        r.cur = i + k
        all_taken += k
        if k < left:  # fewer than the limit: k covers `rem` (allocatable is never negative)
            rem = cy.zero
            break
        rem = vsub(rem, tuple([x * k for x in a]))
        if not any(rem):
            break
    n.remaining = rem
    n.credited += all_taken
    if state == CONFIGURED and all_taken:
        cy.hconf[n.cluster] = cy.hconf.get(n.cluster, 0) + all_taken
        n.conf_credited += all_taken
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


def keep_stream(cy: CycleScratch, n: NeedRow, state: int, lists: list[tuple[MClass, list[Machine]]]
                 ) -> Iterable[tuple[MClass, Machine]]:
    """Bound machines in keep order: price asc, reclamation desc, id asc; held ones skipped."""
    claim = cy.held_in(n.cluster).ids()
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
    if not any(n.remaining):
        return
    bound = cy.ix.bound.get(n.cluster)
    if bound:  # nothing bound here (every need of a bootstrapping cluster): no plan to set up
        _credit_bound_checked(cy, n, bound)
    if any(n.remaining):
        credit_reserved(cy, n)


def _credit_bound_checked(cy: CycleScratch, n: NeedRow, bound: dict[int, dict[int, list[Machine]]]) -> None:
    """The need's bound credit: in bulk where its runs are clean, machine by machine where not."""
    for state, runs in _plans(cy, n, bound):
        if not any(n.remaining):
            return
        if _take_runs(cy, n, state, runs):
            continue
        for c, m in keep_stream(cy, n, state, bound_lists(cy, n, state)):
            if not any(n.remaining):
                return
            hold(cy, m, n)
            n.remaining = vsub(n.remaining, cy.alloc[c.idx])


class _Slice:
    """A run of `credit_cluster_bound`: machines of equal allocatable in keep order, `ms[cur:]`
    still unheld and everything before `cur` held."""

    __slots__ = ("alloc", "cur", "ms")

    def __init__(self, alloc: Vec, ms: list[Machine]) -> None:
        self.alloc = alloc
        self.ms = ms
        self.cur = 0


#: per bound state with matching machines: (state is CONFIGURED, its runs in keep order)
_SlicePlan = list[tuple[bool, list[_Slice]]]


def credit_cluster_bound(cy: CycleScratch, cluster: str, rows: list[NeedRow],
                         bound: dict[int, dict[int, list[Machine]]]) -> None:
    """Bound credit (reservations are the caller's) of one cluster's plain rows, in precedence order.

    Only the cluster's own bound machines are read or held, so clusters do not interact here. When
    the rows' eligible classes present in the cluster are, per state, pairwise disjoint or equal
    (needs of distinct shapes: the common case), each run is only ever held as a prefix: no row
    needs `_take_runs`' skip over held machines nor its `isdisjoint` check, and rows with equal
    classes share one plan. Otherwise every row is credited as `credit_plain` does."""
    plans = _cluster_plans(cy, rows, bound)
    if plans is None:
        for n in rows:
            if any(n.remaining):
                _credit_bound_checked(cy, n, bound)
        return
    held = cy.held_in(cluster)
    zero = cy.zero
    units = cy.units
    conf_total = 0
    for n, plan in zip(rows, plans, strict=True):
        rem = n.remaining
        for conf, runs in plan:
            if not any(rem):
                break
            taken = 0
            for r in runs:
                i = r.cur
                ms = r.ms
                left = len(ms) - i
                a = r.alloc
                k = units(rem, a)
                covered = k <= left
                if not covered:
                    k = left
                if k <= 0:
                    continue
                j = r.cur = i + k
                got = ms[i:j]
                held.add_run(n, got)
                n.claimed.extend(got)
                taken += k
                if covered:  # all it takes: k covers `rem` (allocatable is never negative)
                    rem = zero
                    break
                rem = tuple([x - u * k if x > u * k else 0 for x, u in zip(rem, a, strict=False)])  # vsub
                if not any(rem):
                    break
            if taken:
                n.credited += taken
                if conf:
                    n.conf_credited += taken
                    conf_total += taken
        n.remaining = rem
    if conf_total:
        cy.hconf[cluster] = cy.hconf.get(cluster, 0) + conf_total


def _cluster_plans(cy: CycleScratch, rows: list[NeedRow], bound: dict[int, dict[int, list[Machine]]]
                   ) -> list[_SlicePlan] | None:
    """Per row its plan (empty when it wants nothing): one per distinct eligible set, one run list per
    distinct set of the cluster's classes; None when two distinct such sets of one state overlap."""
    #: (state is CONFIGURED, its bound lists, the classes' known stamps, eligible set → its selection
    #: here, the classes some plan already runs over, (classes, runs))
    states: list[tuple[bool, dict[int, list[Machine]], dict[int, float], dict[int, _Selection], set[int],
                       list[tuple[set[int], list[_Slice]]]]] = []
    for st in (CONFIGURED, CONFIGURING):
        by_class = bound.get(st)
        if by_class:
            # clusters holding the same classes (common in a homogeneous fleet) share their selections
            key = (st, tuple(by_class))
            sel_memo = cy.selections.get(key)
            if sel_memo is None:
                sel_memo = cy.selections[key] = {}
            states.append((st == CONFIGURED, by_class, cy.ix.bound_stamp.get(st, _NO_STAMPS), sel_memo, set(), []))
    by_tok: dict[int, _SlicePlan] = {}
    fp_eligible = cy.fp_eligible
    out: list[_SlicePlan] = []
    for n in rows:
        if not any(n.remaining):
            out.append([])
            continue
        hit = fp_eligible.get(n.fp)
        if hit is not None and hit[0] == n.minu:
            tok = hit[1]
        else:
            tok = cy.eligible_set(n)
            fp_eligible[n.fp] = (n.minu, tok)
        plan = by_tok.get(id(tok))  # (the set lives in the scratch's eligibility memo: its id is stable)
        if plan is None:
            plan = by_tok[id(tok)] = []
            for conf, by_class, stamps, sel_memo, covered, sels in states:
                got = sel_memo.get(id(tok))
                if got is None:
                    got = sel_memo[id(tok)] = _selection(cy, tok, by_class, stamps)
                common, one_run = got
                if not common:
                    continue
                if covered.isdisjoint(common):
                    covered |= common
                    runs = _sel_runs(cy, by_class, stamps, common, _one_alloc(cy, tok)) if one_run is None else [
                        _Slice(cy.alloc[one_run[0]], list(chain.from_iterable(map(by_class.__getitem__, one_run))))]
                    sels.append((common, runs))
                else:  # the same classes as another set's (one shared run list), or an overlap
                    same = next((r for c, r in sels if c == common), None)
                    if same is None:
                        return None
                    runs = same
                if runs:
                    plan.append((conf, runs))
        out.append(plan)
    return out


#: an eligible set's classes among a cluster's (of one state), and those classes in keep order when
#: their lists concatenated in that order are one run (one allocatable, one known plain stamp)
_Selection = tuple[set[int], list[int] | None]


def _selection(cy: CycleScratch, tok: set[int], by_class: dict[int, list[Machine]], known: dict[int, float]
               ) -> _Selection:
    """What the eligible set `tok` selects of a cluster's classes (`by_class`, one state), and
    whether it is one run: it depends on the classes alone, so clusters holding the same share it."""
    common = tok.intersection(by_class)
    if not common or not _one_alloc(cy, tok):
        return common, None
    sel = sorted(common, key=cy.keep_rank().__getitem__)
    stamps = list(map(known.get, sel))
    s0 = stamps[0]
    if s0 is None or stamps.count(s0) != len(stamps):  # (a known stamp is plain: never NaN)
        return common, None
    return common, sel


def _one_alloc(cy: CycleScratch, tok: set[int]) -> bool:
    """Whether every class of the eligible set has one allocatable (memoised per set)."""
    got = cy.one_alloc.get(id(tok))
    if got is None:
        got = cy.one_alloc[id(tok)] = len(set(map(cy.alloc_group().__getitem__, tok))) == 1
    return got


def _sel_runs(cy: CycleScratch, by_class: dict[int, list[Machine]], known: dict[int, float], common: set[int],
              one_alloc: bool) -> list[_Slice]:
    """`_keep_runs` over the lists of `common`: C-level passes when every class has one plain
    reclamation stamp (then a class is one segment, and classes sort by (price, stamp desc, rank)).
    `known`: the classes' stamps the index already knows; no record is read for those (a class list
    holds ~2 records at aggregated-500k, so reading its ends is a pass over the fleet)."""
    sel = sorted(common, key=cy.keep_rank().__getitem__)
    lsts = list(map(by_class.__getitem__, sel))
    got = list(map(known.get, sel))
    if None in got:
        # (attribute reads in a comprehension: cheaper than a dotted attrgetter)
        firsts = [lst[0].assignment.reclamation_penalty_dollars for lst in lsts]
        lasts = [lst[-1].assignment.reclamation_penalty_dollars for lst in lsts]
    else:
        firsts = lasts = cast(list[float], got)
    s0 = firsts[0]
    if one_alloc and s0 >= 0 and firsts.count(s0) == len(firsts) and lasts.count(s0) == len(lasts):
        return [_Slice(cy.alloc[sel[0]], list(chain.from_iterable(lsts)))]  # one plain stamp (common): one run
    if firsts != lasts or any(map(isnan, firsts)) or min(firsts) < 0:
        return [_Slice(a, ms) for a, ms in _mixed_stamp_runs(cy, by_class, common)] or [
            _Slice(a, ms) for a, ms in _keep_runs(cy, [(cy.ix.classes[ci], by_class[ci]) for ci in sel])]
    if firsts.count(firsts[0]) != len(firsts):  # (ranks are unique: tuples never compare past them)
        order = sorted(zip(map(cy.class_prices().__getitem__, sel), map(neg, firsts),
                           map(cy.class_rank().__getitem__, sel), range(len(sel)), strict=True))
        pick = list(map(_FOURTH, order))
        sel = list(map(sel.__getitem__, pick))
        lsts = list(map(lsts.__getitem__, pick))
    alloc = cy.alloc
    groups = list(map(cy.alloc_group().__getitem__, sel))
    if groups.count(groups[0]) == len(groups):  # one allocatable (common): one run
        return [_Slice(alloc[sel[0]], list(chain.from_iterable(lsts)))]
    runs = []
    for _, grp in groupby(range(len(sel)), key=groups.__getitem__):
        pos = list(grp)
        runs.append(_Slice(alloc[sel[pos[0]]], list(chain.from_iterable(map(lsts.__getitem__, pos)))))
    return runs


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
