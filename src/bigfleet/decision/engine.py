"""`decide()`: one deterministic decision cycle (normalise → Phase 1 → Phase 2 → Phase 3 → ledgers).

Single-threaded and sequential in a total precedence order, which gives exactly the outcome the
upstream optimistic-concurrency engine promises ("as if one pass in priority order") without its
nondeterminism. See docs/decision-engine.md for the rules and every deliberate deviation.
"""

from __future__ import annotations

import gc
import heapq
import math
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import groupby, islice, repeat
from operator import attrgetter
from typing import Any, TypeVar

from bigfleet.machine.inventory import Inventory
from bigfleet.machine.record import Machine, MachineShape
from bigfleet.machine.state import CapacityType, MachineState
from bigfleet.needs import EMPTY, Need, NeedsTable, Operator, Profile, Requirement, Resources, TopologySpread
from bigfleet.needs.penalty import bucket_dollars

from .index import (
    CONFIGURED,
    CONFIGURING,
    IDLE,
    SPEC,
    Index,
    MClass,
    add_machine,
    build_index,
    free_supply,
    m_interruption,
    m_reclamation,
    remove_machine,
    victim_order,
)
from .types import (
    DRAIN_GRACE_DEFAULT_SECONDS,
    DRAIN_GRACE_TIERS,
    REASON_IDLE,
    REASON_SPECULATIVE,
    Action,
    Configure,
    Create,
    Decision,
    Delete,
    Drain,
    EngineConfig,
    EngineState,
    MatchingSupply,
    PhaseStats,
    Shortfall,
    UnmetReason,
    Verdict,
    drain_grace_seconds,
    victim_score,
)

Vec = tuple[int, ...]
_ID = attrgetter("id")
_RECL = attrgetter("assignment.reclamation_penalty_dollars")
_CONFIGURED_STATE = MachineState.CONFIGURED


def _sub(a: Vec, b: Vec) -> Vec:
    return tuple([x - y if x > y else 0 for x, y in zip(a, b, strict=False)])


def _covers(have: Vec, want: Vec) -> bool:
    for h, w in zip(have, want, strict=False):  # noqa: SIM110 - an explicit loop is faster
        if h < w:
            return False
    return True


def _add(a: Vec, b: Vec) -> Vec:
    return tuple([x + y for x, y in zip(a, b, strict=False)])


class _N:
    """One (normalised) need being decided, plus its per-cycle results."""

    __slots__ = (
        "acquired_idle",
        "acquired_spec",
        "agg",
        "arrival",
        "claimed",
        "cluster",
        "credited",
        "fp",
        "freed",
        "group",
        "ib",
        "key",
        "members",
        "minu",
        "need",
        "order",
        "p1_remaining",
        "park_age",
        "park_key",
        "parked",
        "prio",
        "rb",
        "remaining",
        "reqs",
        "reserved_credit",
        "same",
        "same_domain",
        "same_sat",
        "spreads",
        "unmet_age",
        "victims",
    )

    def __init__(self, need: Need, members: list[Need], dims: tuple[str, ...]) -> None:
        p = need.profile
        self.need = need
        self.members = members
        self.cluster = need.cluster_id
        self.fp = p.fingerprint()
        self.reqs = p.requirements
        self.prio = int(p.priority)
        self.ib = int(p.interruption_bucket)
        self.rb = int(p.reclamation_bucket)
        self.group = p.group
        same: Requirement | None = None
        for r in p.requirements:
            if r.operator is Operator.SAME:
                same = r
                break
        self.same = same
        #: every DoNotSchedule spread term (a gang's Same supersedes them)
        self.spreads: tuple[TopologySpread, ...] = (
            tuple(s for s in p.spread if s.strict) if same is None else ())
        am = need.aggregate_resources._map
        self.agg: Vec = tuple([am.get(d, 0) for d in dims])
        mm = need.min_unit._map
        self.minu: Vec = tuple([mm.get(d, 0) for d in dims])
        self.arrival = need.arrival_unix_nanos
        self.order = (-self.prio, -(self.ib if self.ib > 1 else 1), -(self.rb if self.rb > 1 else 1), self.arrival,
                      self.cluster, self.fp)
        self.key = self.cluster + "\x00" + self.fp
        self.park_key = self.cluster + "\x00" + self.group + "\x00" + self.fp
        self.parked = False
        self.park_age = 0
        self.remaining: Vec = self.agg
        self.p1_remaining: Vec = self.agg
        self.reserved_credit = False
        self.claimed: list[Machine] = []
        self.credited = 0
        self.acquired_idle: list[Machine] = []
        self.acquired_spec: list[Machine] = []
        self.same_domain = ""
        self.same_sat = False
        self.victims = 0
        self.freed: Vec = tuple([0] * len(dims))
        self.unmet_age = 0


class _Cycle:
    """Mutable scratch state of one `decide` call (never escapes it)."""

    def __init__(self, ix: Index, dims: tuple[str, ...], reservations: Mapping[str, str]) -> None:
        self.ix = ix
        self.dims = dims
        self.reservations = reservations
        self.alloc: list[Vec] = [tuple(c.alloc.get(d) for d in dims) for c in ix.classes]
        #: claims on pool (Idle/Speculative) and Creating machines
        self.claim: dict[str, _N] = {}
        #: cluster → claims on its bound (Configured/Configuring) machines
        self.held: dict[str, dict[str, _N]] = {}
        self.bcur: dict[tuple[str, int, int], int] = {}
        #: cluster → how many of its CONFIGURED machines are held
        self.hconf: dict[str, int] = {}
        self.cursor: dict[tuple[int, int], int] = {}
        self.taken: dict[tuple[int, int], int] = {}
        self.vused: dict[tuple[int, int], int] = {}
        #: DRAINING machines already counted against some need's deficit this cycle (Phase 2)
        self.awaited: set[str] = set()
        self.zero: Vec = tuple(0 for _ in dims)
        self._eligible: dict[tuple[tuple[Requirement, ...], Vec], list[MClass]] = {}
        self._eligible_set: dict[tuple[tuple[Requirement, ...], Vec], set[int]] = {}
        # Caches keyed by id() of a list also hold that list, so the id cannot be reused by another
        # object while the entry exists (a hit is also checked by identity).
        self._ordered: dict[tuple[int, int, float], tuple[list[MClass], list[list[MClass]]]] = {}
        self._heaps: dict[tuple[int, int], tuple[list[MClass], list[tuple[float, str, int]]]] = {}
        self._band: dict[int, tuple[Any, list[tuple[Vec, list[Machine]]] | None]] = {}
        self.rcur: dict[tuple[int, int], int] = {}
        self._merged: dict[int, tuple[Any, list[tuple[MClass, Machine]]]] = {}
        self.mcur: dict[int, int] = {}
        self._domains: dict[tuple[tuple[Requirement, ...], Vec, str], list[tuple[str, list[MClass]]]] = {}
        self._bound: dict[tuple[str, int, tuple[Requirement, ...], Vec], list[tuple[MClass, list[Machine]]]] = {}

    # --- pool cursors ---------------------------------------------------------------------------

    def head(self, key: tuple[int, int]) -> Machine | None:
        lst = self.ix.pool.get(key)
        if not lst:
            return None
        i = self.cursor.get(key, 0)
        claim = self.claim
        n = len(lst)
        while i < n and lst[i].id in claim:
            i += 1
        self.cursor[key] = i
        return lst[i] if i < n else None

    def available(self, key: tuple[int, int]) -> int:
        lst = self.ix.pool.get(key)
        if not lst:
            return 0
        return len(lst) - self.taken.get(key, 0) - self.vused.get(key, 0)

    def take(self, m: Machine, n: _N, key: tuple[int, int] | None) -> None:
        self.claim[m.id] = n
        n.claimed.append(m)
        if key is not None:
            self.taken[key] = self.taken.get(key, 0) + 1

    def eligible(self, n: _N) -> list[MClass]:
        """Classes matching the need's requirements whose allocatable covers its MinUnit (cached)."""
        k = (n.reqs, n.minu)
        got = self._eligible.get(k)
        if got is None:
            alloc = self.alloc
            minu = n.minu
            got = [c for c in self.ix.matched_classes(n.reqs) if _covers(alloc[c.idx], minu)]
            self._eligible[k] = got
        return got

    def eligible_set(self, n: _N) -> set[int]:
        k = (n.reqs, n.minu)
        got = self._eligible_set.get(k)
        if got is None:
            got = self._eligible_set[k] = {c.idx for c in self.eligible(n)}
        return got

    def domains(self, n: _N, key: str) -> list[tuple[str, list[MClass]]]:
        """Eligible classes grouped by their value of `key` (classes without the key dropped)."""
        k = (n.reqs, n.minu, key)
        got = self._domains.get(k)
        if got is None:
            by: dict[str, list[MClass]] = {}
            for c in self.eligible(n):
                v = c.attrs.get(key)
                if v is not None:
                    by.setdefault(v, []).append(c)
            got = [(v, sorted(cl, key=lambda c: c.sort_key)) for v, cl in sorted(by.items())]
            self._domains[k] = got
        return got


# --------------------------------------------------------------------------------------------
# Normalisation: fold sub-machine Same gangs into plain needs
# --------------------------------------------------------------------------------------------


def _strip_same(p: Profile) -> Profile:
    return Profile(
        tuple(r for r in p.requirements if r.operator is not Operator.SAME),
        p.spread,
        p.priority,
        p.interruption_bucket,
        p.reclamation_bucket,
        "",
    )


def normalize(needs: Sequence[Need], ix: Index, free_classes: set[int] | None = None
              ) -> tuple[list[tuple[Need, list[Need]]], int]:
    """Fold Same needs whose whole aggregate fits on one machine into plain needs.

    See `_normalize` (which also says whether the free pool decided any fold).
    """
    out, folded, _ = _normalize(needs, ix, free_classes)
    return out, folded


def _normalize(needs: Sequence[Need], ix: Index, free_classes: set[int] | None = None
               ) -> tuple[list[tuple[Need, list[Need]]], int, bool]:
    """Fold Same needs whose whole aggregate fits on one machine into plain needs.

    A gang that fits on one machine cannot be split across domains, so co-location is automatic;
    folding keeps the machine-exclusive claim ledger honest (two sub-machine gangs share one
    machine instead of each claiming one). A gang is foldable when some machine matching its
    profile covers the whole aggregate: one of its own cluster's bound machines, or any Idle or
    Speculative machine. Returns (need, original members) rows, the count of folded gangs, and
    whether any fold decision depended on the free pool (no own bound class settled it): only
    then does a cached result of these needs go stale when the free pool changes.
    """
    out: list[tuple[Need, list[Need]]] = []
    groups: dict[tuple[str, str, Resources], list[Need]] = {}
    stripped: dict[tuple[str, str, Resources], Profile] = {}
    strip_memo: dict[tuple[Any, ...], Profile] = {}
    if free_classes is None:
        free_classes = {ci for (_st, ci) in ix.pool}
    own_memo: dict[str, set[int]] = {}
    memo: dict[tuple[str, tuple[Requirement, ...], Resources], bool] = {}
    folded = 0
    free_dependent = False
    for n in needs:
        p = n.profile
        if p.same is None or n.aggregate_resources.is_zero():
            out.append((n, [n]))
            continue
        agg = n.aggregate_resources
        mk = (n.cluster_id, p.requirements, agg)
        ok = memo.get(mk)
        if ok is None:
            ok = False
            own_classes = own_memo.get(n.cluster_id)
            if own_classes is None:
                own = ix.bound.get(n.cluster_id, {})
                own_classes = set(own.get(CONFIGURED, {})) | set(own.get(CONFIGURING, {}))
                own_memo[n.cluster_id] = own_classes
            fitting = [c.idx for c in ix.matched_classes(p.requirements) if agg.fits_in(c.alloc)]
            if any(ci in own_classes for ci in fitting):
                ok = True
            else:
                free_dependent = True
                ok = any(ci in free_classes for ci in fitting)
            memo[mk] = ok
        if not ok:
            out.append((n, [n]))
            continue
        sk = (p.requirements, p.spread, p.priority, p.interruption_bucket, p.reclamation_bucket)
        sp = strip_memo.get(sk)
        if sp is None:
            sp = strip_memo[sk] = _strip_same(p)
        gk = (n.cluster_id, sp.fingerprint(), agg)
        stripped[gk] = sp
        groups.setdefault(gk, []).append(n)
        folded += 1
    for gk in sorted(groups, key=lambda k: (k[0], k[1], k[2].items())):
        members = groups[gk]
        agg = gk[2]
        minu = agg
        for m in members:
            minu = minu.max(m.min_unit)
        arrivals = [m.arrival_unix_nanos for m in members if m.arrival_unix_nanos]
        out.append((Need(gk[0], stripped[gk], agg.scale(len(members)), minu, min(arrivals) if arrivals else 0),
                    members))
    return out, folded, free_dependent


# --------------------------------------------------------------------------------------------
# Phase 1
# --------------------------------------------------------------------------------------------


def _bound_lists(cy: _Cycle, n: _N, state: int) -> list[tuple[MClass, list[Machine]]]:
    by_class = cy.ix.bound.get(n.cluster, {}).get(state)
    if not by_class:
        return []
    k = (n.cluster, state, n.reqs, n.minu)
    got = cy._bound.get(k)
    if got is None:
        elig = cy.eligible(n)
        if len(by_class) < len(elig):
            eset = cy.eligible_set(n)
            classes = cy.ix.classes
            got = [(classes[ci], lst) for ci, lst in by_class.items() if ci in eset]
        else:
            got = [(c, by_class[c.idx]) for c in elig if c.idx in by_class]
        got.sort(key=lambda t: (t[0].price, t[0].idx))
        cy._bound[k] = got
    return got


def _hold(cy: _Cycle, m: Machine, n: _N) -> None:
    h = cy.held.get(n.cluster)
    if h is None:
        h = cy.held[n.cluster] = {}
    h[m.id] = n
    n.claimed.append(m)
    n.credited += 1
    if m.state is _CONFIGURED_STATE:
        cy.hconf[n.cluster] = cy.hconf.get(n.cluster, 0) + 1


def _band_hold(cy: _Cycle, n: _N, state: int, lists: list[tuple[MClass, list[Machine]]]) -> bool:
    """Credit in bulk. The keep order over several classes is precomputed once per cycle as a few
    "runs" (segments of equal price and reclamation penalty, class after class, neighbours of equal
    allocatable concatenated), so crediting a need is one slice and one C-level dict update per run.
    False: a run was not clean (the caller finishes machine by machine; nothing taken is undone)."""
    hit = cy._band.get(id(lists))
    if hit is not None and hit[0] is lists:
        runs = hit[1]
    else:
        # split every class list into segments of equal reclamation penalty (contiguous: the list is
        # in keep order), order segments by (price, reclamation desc, class), then concatenate
        # neighbours of equal allocatable into runs
        segs: list[tuple[float, float, Any, Vec, list[Machine], int, int]] = []
        for c, lst in lists:
            a = cy.alloc[c.idx]
            if _RECL(lst[0]) == _RECL(lst[-1]):  # one penalty in the whole class (the common case)
                segs.append((c.price, -m_reclamation(lst[0]), c.sort_key, a, lst, 0, len(lst)))
                continue
            pos = 0
            for r, grp in groupby(map(m_reclamation, lst)):
                cnt = len(list(grp))
                segs.append((c.price, -r, c.sort_key, a, lst, pos, pos + cnt))
                pos += cnt
        segs.sort(key=lambda t: (t[0], t[1], t[2]))
        runs = []
        for _, _, _, a, lst, lo, hi in segs:
            if runs and runs[-1][0] == a:
                runs[-1][1].extend(lst[lo:hi])
            else:
                runs.append((a, lst[lo:hi]))
        cy._band[id(lists)] = (lists, runs)
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
        k = _units_to_cover(n.remaining, a, size - i)
        if k <= 0:
            continue
        chunk = run[i:i + k]
        ids = list(map(_ID, chunk))
        if any(map(held.__contains__, ids)):
            clean = False
            break
        held.update(zip(ids, repeat(n)))
        n.claimed.extend(chunk)
        n.credited += k
        rcur[ck] = i + k
        n.remaining = _sub(n.remaining, tuple([x * k for x in a]))
        all_taken += k
    if state == CONFIGURED and all_taken:
        cy.hconf[n.cluster] = cy.hconf.get(n.cluster, 0) + all_taken
    return clean


def _bulk_hold(cy: _Cycle, n: _N, state: int, c: MClass, lst: list[Machine]) -> bool:
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
    k = _units_to_cover(n.remaining, a, size - i)
    if k <= 0:
        return size - i == 0
    chunk = lst[i:i + k]
    ids = list(map(_ID, chunk))
    if any(map(held.__contains__, ids)):
        return False
    held.update(zip(ids, repeat(n)))
    n.claimed.extend(chunk)
    n.credited += k
    n.remaining = _sub(n.remaining, tuple([x * k for x in a]))
    cy.bcur[ck] = i + k
    if state == CONFIGURED:
        cy.hconf[n.cluster] = cy.hconf.get(n.cluster, 0) + k
    return True


def _keep_stream(cy: _Cycle, n: _N, state: int, lists: list[tuple[MClass, list[Machine]]]
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
    # equal-value machines stays contiguous, which is what lets `_credit_plain` credit it in bulk)
    # The merged order of a given set of lists is computed once per cycle and walked with a cursor.
    mk = id(lists)
    hit = cy._merged.get(mk)
    if hit is not None and hit[0] is lists:
        got = hit[1]
    else:
        items = [(c.price, -m_reclamation(m), c.sort_key, m.id, c, m) for c, lst in lists for m in lst]
        items.sort(key=lambda t: (t[0], t[1], t[2], t[3]))
        got = [(t[4], t[5]) for t in items]
        cy._merged[mk] = (lists, got)
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


def _credit_plain(cy: _Cycle, n: _N) -> None:
    for state in (CONFIGURED, CONFIGURING):
        if not any(n.remaining):
            return
        lists = _bound_lists(cy, n, state)
        if len(lists) == 1:
            if _bulk_hold(cy, n, state, lists[0][0], lists[0][1]):
                continue
        elif lists and _band_hold(cy, n, state, lists):
            continue
        for c, m in _keep_stream(cy, n, state, lists):
            if not any(n.remaining):
                return
            _hold(cy, m, n)
            n.remaining = _sub(n.remaining, cy.alloc[c.idx])
    if any(n.remaining):
        _credit_reserved(cy, n)


def _credit_reserved(cy: _Cycle, n: _N, domain: str | None = None) -> None:
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
            if not _covers(cy.alloc[c.idx], n.minu) or not all(r.matches(c.attrs) for r in n.reqs):
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
            n.remaining = _sub(n.remaining, cy.alloc[c.idx])


class _Bucket:
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


def choose_same_bucket(buckets: Iterable[_Bucket], deficit: Vec) -> _Bucket | None:
    """The documented total order over candidate domains (decision-engine.md §8.3)."""
    best: _Bucket | None = None
    best_k: tuple[Any, ...] = ()
    for b in buckets:
        if b.count == 0:
            continue
        sat = _covers(b.total, deficit)
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


def _credit_same(cy: _Cycle, n: _N, sticky: str | None) -> None:
    same = n.same
    assert same is not None
    key = same.key
    buckets: dict[str, _Bucket] = {}
    zero = cy.zero
    alloc = cy.alloc
    for state in (CONFIGURED, CONFIGURING):
        for c, m in _keep_stream(cy, n, state, _bound_lists(cy, n, state)):
            v = c.attrs.get(key)
            if v is None:
                continue
            b = buckets.get(v)
            if b is None:
                b = buckets[v] = _Bucket(v, zero)
            a = alloc[c.idx]
            own = m.assignment.need_fingerprint == n.fp and m.assignment.group == n.group
            b.count += 1
            b.total = _add(b.total, a)
            b.cred = _add(b.cred, a)
            if own:
                b.cred_own = _add(b.cred_own, a)
            b.members.append((c, m, own))
    _count_creating(cy, n, key, buckets)
    if not n.parked:
        for v, classes in cy.domains(n, key):
            count = 0
            total = None
            for c in classes:
                for state in (IDLE, SPEC):
                    avail = cy.available((state, c.idx))
                    if avail > 0:
                        count += avail
                        a = tuple([x * avail for x in alloc[c.idx]])
                        total = a if total is None else _add(total, a)
            if total is None:
                continue
            b = buckets.get(v)
            if b is None:
                b = buckets[v] = _Bucket(v, zero)
            b.count += count
            b.total = _add(b.total, total)
    if not buckets:
        return
    best: _Bucket | None = None
    if sticky is not None and sticky in buckets and _covers(buckets[sticky].total, n.remaining):
        best = buckets[sticky]
    if best is None:
        best = choose_same_bucket((buckets[v] for v in sorted(buckets)), n.remaining)
    if best is None:
        return
    n.same_domain = best.value
    n.same_sat = _covers(best.total, n.remaining)
    ordered = [t for t in best.members if t[2]] + [t for t in best.members if not t[2]]
    for c, m, _own in ordered:
        if not any(n.remaining):
            break
        _hold(cy, m, n)
        n.remaining = _sub(n.remaining, alloc[c.idx])
    if any(n.remaining):
        _credit_reserved(cy, n, best.value)
    if any(n.remaining) and not n.parked:
        # Virtually reserve the chosen domain's free supply so needs ranked later see what is left.
        rem = n.remaining
        dom_classes = next((cl for v, cl in cy.domains(n, key) if v == best.value), [])
        for state in (IDLE, SPEC):
            for c in dom_classes:
                k = (state, c.idx)
                avail = cy.available(k)
                a = alloc[c.idx]
                used = _units_to_cover(rem, a, avail)
                if used:
                    rem = _sub(rem, tuple([x * used for x in a]))
                    cy.vused[k] = cy.vused.get(k, 0) + used
                if not any(rem):
                    return


def _count_creating(cy: _Cycle, n: _N, key: str, buckets: dict[str, _Bucket]) -> None:
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
            b = buckets[v] = _Bucket(v, cy.zero)
        a = cy.alloc[c.idx]
        b.count += 1
        b.total = _add(b.total, a)
        b.cred = _add(b.cred, a)
        b.cred_own = _add(b.cred_own, a)


def _units_to_cover(rem: Vec, unit: Vec, limit: int) -> int:
    """How many machines of allocatable `unit` (at most `limit`) it takes to cover `rem`."""
    need = 0
    for r, u in zip(rem, unit, strict=False):
        if r > 0:
            if u <= 0:
                return limit
            k = -(-r // u)
            if k > need:
                need = k
    return min(need, limit)


def _ordered_classes(cy: _Cycle, classes: list[MClass], state: int, penalty: float) -> list[list[MClass]]:
    """Classes with supply in `state`, grouped by equal effective cost, cheapest group first (cached)."""
    ck = (id(classes), state, penalty)  # class lists come from per-cycle caches: identity is stable
    hit = cy._ordered.get(ck)
    if hit is not None and hit[0] is classes:
        return hit[1]
    got = _order_classes(cy, classes, state, penalty)
    cy._ordered[ck] = (classes, got)
    return got


def _order_classes(cy: _Cycle, classes: list[MClass], state: int, penalty: float) -> list[list[MClass]]:
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


def _next_in_group(cy: _Cycle, state: int, group: list[MClass]) -> tuple[MClass, Machine] | None:
    """The next unclaimed machine of a group of equal-cost classes: reclamation asc, then id.

    Groups of several classes keep a lazily validated heap of class heads, so picking is
    O(log classes) instead of a scan of every class per pick.
    """
    if len(group) == 1:
        c = group[0]
        m = cy.head((state, c.idx))
        return None if m is None else (c, m)
    gk = (state, id(group))
    hit = cy._heaps.get(gk)
    h = hit[1] if hit is not None and hit[0] is group else None
    if h is None:
        h = []
        for c in group:
            m = cy.head((state, c.idx))
            if m is not None:
                h.append((m_reclamation(m), m.id, c.idx))
        heapq.heapify(h)
        cy._heaps[gk] = (group, h)
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


def _bulk_take(cy: _Cycle, n: _N, state: int, c: MClass) -> None:
    """Take from one class what covers the need, in pool order, in one sweep: the same machines
    the one-at-a-time loop picks (a class's pool list is already in pick order), without a
    function call and a vector per machine (reprovisioning places tens of thousands per cycle)."""
    key = (state, c.idx)
    lst = cy.ix.pool.get(key)
    if not lst:
        return
    a = cy.alloc[c.idx]
    k = _units_to_cover(n.remaining, a, len(lst))
    if k <= 0:
        return
    claim = cy.claim
    i = cy.cursor.get(key, 0)
    size = len(lst)
    got = lst[i:i + k]
    ids = list(map(_ID, got))
    if any(map(claim.__contains__, ids)):  # some already claimed (reservations): walk and skip them
        got = []
        while i < size and len(got) < k:
            m = lst[i]
            if m.id not in claim:
                got.append(m)
            i += 1
        ids = list(map(_ID, got))
    else:
        i += len(got)
    cy.cursor[key] = i
    if not got:
        return
    claim.update(zip(ids, repeat(n)))
    n.claimed.extend(got)
    cy.taken[key] = cy.taken.get(key, 0) + len(got)
    (n.acquired_idle if state == IDLE else n.acquired_spec).extend(got)
    taken = len(got)
    n.remaining = _sub(n.remaining, tuple([x * taken for x in a]))


def _acquire(cy: _Cycle, n: _N, classes: list[MClass], penalty: float) -> None:
    for state in (IDLE, SPEC):
        for group in _ordered_classes(cy, classes, state, penalty):
            if len(group) == 1:
                _bulk_take(cy, n, state, group[0])
                if not any(n.remaining):
                    return
                continue
            while any(n.remaining):
                nxt = _next_in_group(cy, state, group)
                if nxt is None:
                    break
                c, m = nxt
                cy.take(m, n, (state, c.idx))
                (n.acquired_idle if state == IDLE else n.acquired_spec).append(m)
                n.remaining = _sub(n.remaining, cy.alloc[c.idx])
            if not any(n.remaining):
                return


def _acquire_spread(cy: _Cycle, n: _N, classes: list[MClass], penalty: float) -> None:
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
        groups = {dom: _ordered_classes(cy, cl, state, penalty) for dom, cl in sorted(by_dom.items())}
        while any(n.remaining) and groups:
            pick = _spread_pick(cy, state, groups, counts, skews, penalty)
            if pick is None:
                break
            dom, c, m = pick
            cy.take(m, n, (state, c.idx))
            (n.acquired_idle if state == IDLE else n.acquired_spec).append(m)
            n.remaining = _sub(n.remaining, cy.alloc[c.idx])
            for i, v in enumerate(dom):
                counts[i][v] += 1


def _spread_pick(cy: _Cycle, state: int, groups: dict[tuple[str, ...], list[list[MClass]]],
                 counts: list[dict[str, int]], skews: list[int], penalty: float
                 ) -> tuple[tuple[str, ...], MClass, Machine] | None:
    """The cheapest next machine (then the smallest domain tuple) whose every domain is within skew."""
    ceilings = [min(cnt.values()) + skew - 1 for cnt, skew in zip(counts, skews, strict=True)]
    best: tuple[float, tuple[str, ...], MClass, Machine] | None = None
    for dom, dom_groups in groups.items():
        if any(counts[i][v] > ceilings[i] for i, v in enumerate(dom)):
            continue
        for g in dom_groups:
            nxt = _next_in_group(cy, state, g)
            if nxt is not None:
                cost = nxt[0].eff_cost(penalty)
                if best is None or (cost, dom) < (best[0], best[1]):
                    best = (cost, dom, nxt[0], nxt[1])
                break
    return None if best is None else (best[1], best[2], best[3])


def _credit(cy: _Cycle, rows: list[_N], state: EngineState, gangs_first: bool = False) -> None:
    """Pass 1: credit bound supply (and in-flight reservations) in precedence order.

    With `gangs_first`, within one priority level the Same gangs credit before plain needs: a plain
    need can use any matching machine, a gang only the ones in its domain, so letting the plain
    need go first can take a gang's own machines and make it re-acquire elsewhere (need swapping).
    """
    if gangs_first:
        rows = sorted(rows, key=lambda r: (-r.prio, r.same is None))  # stable: precedence order within
    for n in rows:
        if n.same is not None:
            _credit_same(cy, n, state.same_domains.get(n.park_key))
        else:
            _credit_plain(cy, n)


def _acquire_all(cy: _Cycle, rows: list[_N]) -> None:
    """Pass 2: acquire Idle then Speculative for what is left, in precedence order."""
    for n in rows:
        if not any(n.remaining) or n.parked:
            continue
        penalty = bucket_dollars(n.ib)
        classes = cy.eligible(n)
        if n.same is not None:
            if not n.same_domain:
                continue
            dom_classes = next((cl for v, cl in cy.domains(n, n.same.key) if v == n.same_domain), [])
            _acquire(cy, n, dom_classes, penalty)
        elif n.spreads:
            _acquire_spread(cy, n, classes, penalty)
        else:
            _acquire(cy, n, classes, penalty)


# --------------------------------------------------------------------------------------------
# Phase 2
# --------------------------------------------------------------------------------------------


#: the drain grace of each priority tier of `_grace_bounds` (the last tier is never a victim)
_TIER_GRACE = (*(sec for _, sec in DRAIN_GRACE_TIERS), DRAIN_GRACE_DEFAULT_SECONDS)

_VKey = tuple[float, int, str]


def _grace_bounds(preemptor_priority: int) -> tuple[int, ...]:
    """Stamped priorities below bound i (and not below bound i-1) drain with ``_TIER_GRACE[i]``
    when this preemptor takes them; the last bound is the preemptor itself (strictly lower only)."""
    return (*(preemptor_priority - above for above, _ in DRAIN_GRACE_TIERS), preemptor_priority)


def _victim_key(m: Machine, grace_s: int) -> _VKey:
    """Lowest first: the seeds' victim score with the drain grace the victim still has, then lower
    stamped priority, then id. A CONFIGURED candidate has not started draining, so the grace it
    still has is the whole grace its preempt Drain carries (docs/decision-engine.md, step 7)."""
    return (victim_score(m_interruption(m), m_reclamation(m), grace_s, m.shape.price_per_hour),
            m.assignment.priority, m.id)


def _await_draining(cy: _Cycle, n: _N, classes: list[MClass]) -> bool:
    """Count DRAINING machines of the need's classes against its deficit (each machine once per cycle,
    in precedence order): a drain already under way, typically this need's own victim from an
    earlier cycle, brings the machine back to the pool, so choosing another victim for the same
    deficit would preempt twice. True when nothing is left to preempt for."""
    draining = cy.ix.draining_by_class
    if not draining:
        return False
    awaited = cy.awaited
    for c in classes:
        lst = draining.get(c.idx)
        if not lst:
            continue
        a = cy.alloc[c.idx]
        for m in lst:
            if m.id in awaited:
                continue
            awaited.add(m.id)
            n.remaining = _sub(n.remaining, a)
            if not any(n.remaining):
                return True
    return False


def _phase2(cy: _Cycle, rows: list[_N], config: EngineConfig, stats: dict[str, int]
            ) -> tuple[list[Action], set[str]]:
    actions: list[Action] = []
    victims: set[str] = set()
    ix = cy.ix
    held = cy.held
    for n in rows:
        if not any(n.remaining) or n.parked or n.unmet_age < config.preempt_after_cycles:
            continue
        if n.same is not None and not n.same_domain:
            continue
        if n.same is not None:
            classes = next((cl for v, cl in cy.domains(n, n.same.key) if v == n.same_domain), [])
        else:
            classes = cy.eligible(n)
        prio = n.prio
        bounds = _grace_bounds(prio)

        def tier_key(m: Machine, bounds: tuple[int, ...] = bounds) -> _VKey:
            # `_victim_key` with the grace of the *stamped* priority's tier, inlined: this runs for
            # every candidate the scan reads
            q = m.assignment.priority
            return (victim_score(m_interruption(m), m_reclamation(m), _TIER_GRACE[bisect_right(bounds, q)],
                                 m.shape.price_per_hour), q, m.id)

        lists = []
        for c in classes:
            if c.idx not in ix.configured_by_class:
                continue
            lst = victim_order(ix, c.idx, bounds, tier_key)
            if lst:
                lists.append(lst)
        if _await_draining(cy, n, classes) or not lists:
            continue

        def take(m: Machine, vprio: int, n: _N = n) -> None:
            victims.add(m.id)
            a = cy.alloc[ix.class_of_shape[m.shape]]
            n.victims += 1
            n.freed = _add(n.freed, a)
            n.remaining = _sub(n.remaining, a)
            actions.append(Drain(m.id, m.cluster, drain_grace_seconds(n.prio, vprio), n.prio, "preempt"))

        # The lists are in stamped-tier key order. A machine credited this cycle to a need of its
        # cluster with a higher priority than its stamp (still below this one) drains with that
        # priority's grace, which may be longer: its true key is larger, so it waits in `later`
        # until the stream has passed that key (every later machine's true key is at least its
        # stream key). Keys are unique: they end in the machine id.
        later: list[tuple[_VKey, Machine, int]] = []
        stream: Iterable[Machine] = lists[0] if len(lists) == 1 else heapq.merge(*lists, key=tier_key)
        for m in stream:
            if not any(n.remaining):
                break
            stats["victims_scanned"] += 1
            if m.id in victims:
                continue
            q = m.assignment.priority  # < prio: the lists hold only strictly lower stamps
            vprio = q
            h = held.get(m.cluster)
            holder = h.get(m.id) if h is not None else None
            if holder is not None:
                if holder is n or holder.prio >= prio:
                    continue
                vprio = max(q, holder.prio)
            if math.isinf(m_interruption(m)):
                continue
            if later:
                k = tier_key(m)
                while later and later[0][0] <= k and any(n.remaining):
                    _, lm, lv = heapq.heappop(later)
                    take(lm, lv)
                if not any(n.remaining):
                    break
            if vprio != q and drain_grace_seconds(prio, vprio) != drain_grace_seconds(prio, q):
                heapq.heappush(later, (_victim_key(m, drain_grace_seconds(prio, vprio)), m, vprio))
                continue
            take(m, vprio)
        while later and any(n.remaining):
            _, lm, lv = heapq.heappop(later)
            take(lm, lv)
    return actions, victims


# --------------------------------------------------------------------------------------------
# Phase 3
# --------------------------------------------------------------------------------------------


def _reclaim_key(m: Machine) -> tuple[float, float, str]:
    # cheapest to lose first: lowest reclamation penalty, then the most expensive, then id
    return (m_reclamation(m), -m.shape.price_per_hour, m.id)


def _reclaim_desc_key(m: Machine) -> tuple[float, float, str]:
    return (-m_reclamation(m), m.shape.price_per_hour, m.id)


def _excess(cy: _Cycle, cluster: str, grace: int, limit: int, exclude: set[str]) -> tuple[list[Drain], int]:
    """The first `limit` reclaim drains of the cluster's unclaimed Configured machines, cheapest to
    lose first (reclamation asc, price desc, id desc), and how many such machines there are.

    Each class list is kept in keep order, so its unclaimed tail read backwards is already in reclaim
    order; a lazy merge produces only the head the cap lets through.
    """
    by_class = cy.ix.bound.get(cluster, {}).get(CONFIGURED, {})
    held = cy.held.get(cluster) or {}
    total = cy.ix.configured_count.get(cluster, 0) - cy.hconf.get(cluster, 0)
    if exclude:
        total -= sum(1 for lst in by_class.values() for m in lst if m.id in exclude and m.id not in held)
    if total <= 0 or limit <= 0:
        return [], max(0, total)

    def tail(lst: list[Machine]) -> Iterator[Machine]:
        for m in reversed(lst):
            if m.id not in held and m.id not in exclude:
                yield m

    lists = list(by_class.values())
    stream: Iterator[Machine] = tail(lists[0]) if len(lists) == 1 else heapq.merge(
        *(tail(lst) for lst in lists), key=_reclaim_desc_key, reverse=True)
    return [Drain(m.id, cluster, grace, 0, "reclaim") for m in islice(stream, limit)], total


def _releases(cy: _Cycle, now: int, config: EngineConfig) -> list[Action]:
    holds = ((int(CapacityType.ON_DEMAND), config.on_demand_hold_seconds),
             (int(CapacityType.SPOT), config.spot_hold_seconds))
    rel: list[str] = []
    for ctype, hold in holds:
        if hold is None or hold <= 0:
            continue
        limit = now - hold * 1_000_000_000
        claim = cy.claim
        for m in cy.ix.idle_by_type.get(ctype, ()):
            if m.state_since_unix_nanos <= limit and m.id not in claim:
                rel.append(m.id)
    rel.sort()
    return [Delete(mid) for mid in rel]


# --------------------------------------------------------------------------------------------
# decide
# --------------------------------------------------------------------------------------------


def _res(dims: tuple[str, ...], v: Vec) -> Resources:
    return Resources.from_milli({d: x for d, x in zip(dims, v, strict=False) if x})


class _ClusterCache:
    """A cluster whose needs were all met by its own bound machines (nothing global involved), so
    its Phase-1 result, verdicts and excess can be reused while its inputs are unchanged."""

    __slots__ = ("credited", "domains", "drains", "folded", "gangs", "hconf", "held", "key", "needs", "rows",
                 "verdicts")

    def __init__(self, key: tuple[Any, ...], needs: tuple[Need, ...], rows: list[_N], held: dict[str, _N],
                 verdicts: list[Verdict], drains: tuple[tuple[int, float], list[Drain], int] | None,
                 domains: dict[str, str], hconf: int) -> None:
        self.key = key
        self.needs = needs
        self.rows = rows
        self.held = held
        self.verdicts = verdicts
        self.drains = drains
        self.domains = domains
        self.folded = 0
        self.hconf = hconf
        self.credited = sum(n.credited for n in rows)
        #: what `_still_stable` compares against the carried state (Same rows only; usually empty)
        self.gangs = tuple((n.park_key, n.park_age, n.same_domain) for n in rows if n.same is not None)


class Engine:
    """`decide` with memory: keeps the machine index (updated from what changed in the inventory)
    and per-cluster results between cycles, so a steady cycle costs what changed, not the fleet.

    Output is identical to the pure `decide()` for the same inputs; `decide()` is just a fresh
    Engine. Not thread-safe; one Engine per shard leader.
    """

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        #: optional monotonic clock for per-phase timings (`last_phase_seconds`); never affects results
        self._clock = clock
        self.last_phase_seconds: dict[str, float] = {}
        self._ix: Index | None = None
        self._src: Any = None
        self._gen: int | None = None
        self._by_mid: dict[str, Machine] = {}
        self._since_full = 0
        #: every this many syncs the inventory is diffed in full instead of by its changed tail. Only a
        #: safety net (the tail sync is exact for `Inventory`, and a removal forces a full diff anyway),
        #: and a full diff is O(fleet): ~0.5-1 s at 500 000 machines, so every 16th cycle of a busy
        #: shard was slow enough to set its cycle p99 (scale runs: > 1 s).
        self.full_diff_every = 1024
        self._cache: dict[str, _ClusterCache] = {}
        self._cdims: dict[str, tuple[tuple[Need, ...], frozenset[str]]] = {}
        self.last_index_changes = 0

    # --- inventory → index -----------------------------------------------------------------------

    def _sync(self, inventory: Any) -> Index:
        gen = getattr(inventory, "generation", None)
        if self._ix is not None and inventory is self._src and gen is not None and gen == self._gen:
            self.last_index_changes = 0
            return self._ix
        ms: Any = inventory.machines() if hasattr(inventory, "machines") else list(inventory)
        if self._ix is None:
            return self._rebuild(inventory, ms, gen)
        self._since_full += 1
        if (isinstance(inventory, Inventory) and inventory is self._src
                and self._since_full < self.full_diff_every and self._tail_sync(ms)):
            self._gen = gen
            return self._ix
        self._since_full = 0
        by_mid = self._by_mid
        now_ids = set(map(id, ms))
        prev = list(by_mid.values())
        gone = [m for m in prev if id(m) not in now_ids]
        prev_ids = set(map(id, prev))
        added_objs = [m for m in ms if id(m) not in prev_ids]
        if len(gone) + len(added_objs) > max(1000, len(now_ids) // 4):
            return self._rebuild(inventory, ms, gen)
        ix = self._ix
        for old in gone:
            remove_machine(ix, old)
            if by_mid.get(old.id) is old:
                del by_mid[old.id]
        for m in added_objs:
            add_machine(ix, m)
            by_mid[m.id] = m
        self._src, self._gen = inventory, gen
        self.last_index_changes = len(gone) + len(added_objs)
        return ix

    def _tail_sync(self, ms: Any) -> bool:
        """O(changes) sync for `bigfleet.machine.Inventory`, whose every write re-inserts the record at
        the end of its (insertion-ordered) table: new records are exactly the tail that is not in the
        baseline. Returns False (caller does a full diff) when the counts do not add up, e.g. after a
        removal; a periodic full diff (`full_diff_every`) guards against anything else."""
        by_mid = self._by_mid
        added: list[Machine] = []
        for m in reversed(ms):
            if by_mid.get(m.id) is m:
                break
            added.append(m)
        replaced = [old for m in added if (old := by_mid.get(m.id)) is not None]
        if len(ms) != len(by_mid) - len(replaced) + len(added) or len({m.id for m in added}) != len(added):
            return False
        ix = self._ix
        assert ix is not None
        for old in replaced:
            remove_machine(ix, old)
        for m in reversed(added):
            by_mid[m.id] = m
            add_machine(ix, m)
        self.last_index_changes = len(added) + len(replaced)
        return True

    def _rebuild(self, inventory: Any, ms: Any, gen: int | None) -> Index:
        ix = build_index(ms)
        # Holding every baseline record also keeps its id() from being reused by a new record.
        self._by_mid = {m.id: m for m in ms}
        self._since_full = 0
        self._ix = ix
        self._src, self._gen = inventory, gen
        self._cache.clear()
        self.last_index_changes = len(self._by_mid)
        return ix

    def free_supply(self, busy: Iterable[str] = ()) -> dict[MachineShape, tuple[int, int]]:
        """(idle, speculative) free machines per shape as of the last `decide` (cluster-less, not in
        `busy`): O(classes + busy), for availability hints without a walk over the fleet."""
        if self._ix is None:
            return {}
        return free_supply(self._ix, busy, self._by_mid)

    # --- the cycle -------------------------------------------------------------------------------

    def decide(self, needs: Sequence[Need] | NeedsTable, inventory: Any, now_unix_nanos: int,
               state: EngineState, config: EngineConfig, reservations: Mapping[str, str] | None = None
               ) -> Decision:
        """See `decide`."""
        self.last_phase_seconds = {}
        # A cycle allocates many short-lived objects next to a heap of ~10^6 long-lived records; the
        # cyclic collector would rescan that heap over and over. Nothing here makes reference
        # cycles, so pause it for the duration (reference counting still frees everything).
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._mark("start")
            ix = self._sync(inventory)
            self._mark("index")
            return self._decide(ix, _by_cluster(needs), now_unix_nanos, state, config, reservations or {})
        finally:
            if was_enabled:
                gc.enable()

    def _mark(self, phase: str) -> None:
        if self._clock is None:
            return
        t = self._clock()
        last = self.last_phase_seconds.get("_t")
        if last is not None and phase != "start":
            self.last_phase_seconds[phase] = self.last_phase_seconds.get(phase, 0.0) + (t - last)
        self.last_phase_seconds["_t"] = t

    def _decide(self, ix: Index, by_cluster: dict[str, tuple[Need, ...]], now: int, state: EngineState,
                config: EngineConfig, reservations: Mapping[str, str]) -> Decision:
        # dimensions: union over every need (cached per cluster)
        dim_set: set[str] = set()
        cdims = self._cdims
        for c, cn in by_cluster.items():
            got = cdims.get(c)
            if got is None or got[0] is not cn:
                names: set[str] = set()
                for nd in cn:
                    names.update(nd.aggregate_resources.names())
                    names.update(nd.min_unit.names())
                got = cdims[c] = (cn, frozenset(names))
            dim_set |= got[1]
        for c in [c for c in cdims if c not in by_cluster]:
            del cdims[c]
        dims = tuple(sorted(dim_set))
        cy = _Cycle(ix, dims, reservations)
        # A cached cluster depends on the free pool only through Same folding (see `_normalize`): its
        # entry carries free_ver only then, so binds and releases elsewhere do not invalidate it.
        base_key = (dims, ix.classes_ver)
        free_ver = ix.free_ver

        cached: dict[str, _ClusterCache] = {}
        free: set[int] | None = None
        fresh: list[tuple[str, tuple[Need, ...], tuple[Any, ...], list[_N]]] = []
        folded = 0
        n_in = 0
        for c in sorted(by_cluster):
            cn = by_cluster[c]
            n_in += len(cn)
            cver = ix.cluster_ver.get(c, 0)
            cc = self._cache.get(c)
            if (cc is not None and cc.key[0] == base_key and cc.key[1] == cver
                    and (cc.key[2] is None or cc.key[2] == free_ver)
                    and (cc.needs is cn or cc.needs == cn) and (not cc.gangs or _still_stable(cc, state))):
                cached[c] = cc
                cy.held[c] = cc.held
                cy.hconf[c] = cc.hconf
                continue
            if free is None:
                free = {ci for (_st, ci) in ix.pool}
            rows_raw, f, free_dep = _normalize(cn, ix, free)
            key = (base_key, cver, free_ver if free_dep else None)
            folded += f
            rows = [_N(nd, members, dims) for nd, members in rows_raw]
            for n in rows:
                if n.same is not None:
                    age = state.parking.get(n.park_key, 0)
                    n.park_age = age
                    n.parked = age >= config.park_after_cycles and (
                        config.reprobe_every_cycles <= 0 or age % config.reprobe_every_cycles != 0)
            fresh.append((c, cn, key, rows))
        for c in list(self._cache):
            if c not in cached:
                del self._cache[c]

        work = [n for _, _, _, rows in fresh for n in rows]
        work.sort(key=lambda r: r.order)
        self._mark("phase1_prepare")
        _credit(cy, work, state, config.gangs_credit_first)
        # clusters fully served by their own bound machines are cacheable
        stable: set[str] = set()
        for c, _cn, _key, rows in fresh:
            if all(not any(n.remaining) and not n.reserved_credit and not n.parked for n in rows):
                stable.add(c)
        self._mark("phase1_credit")
        _acquire_all(cy, work)
        for n in work:
            n.p1_remaining = n.remaining
            if any(n.remaining):
                n.unmet_age = state.unmet_ages.get(n.key, 0) + 1
        self._mark("phase1_acquire")
        counters = {"victims_scanned": 0}
        p2_actions, _ = _phase2(cy, work, config, counters)
        self._mark("phase2")

        # verdicts and cache entries, cluster by cluster in sorted order
        verdicts: list[Verdict] = []
        new_domains: dict[str, str] = {}
        fresh_by_c = {c: (cn, key, rows) for c, cn, key, rows in fresh}
        for c in sorted(by_cluster):
            cc = cached.get(c)
            if cc is not None:
                verdicts.extend(cc.verdicts)
                new_domains.update(cc.domains)
                continue
            cn, key, rows = fresh_by_c[c]
            vs: list[Verdict] = []
            doms: dict[str, str] = {}
            for n in rows:
                vs.extend(_verdicts(cy, n, any(n.p1_remaining)))
                if n.same is not None and n.same_domain:
                    doms[n.park_key] = n.same_domain
            vs.sort(key=lambda v: (v.fingerprint, v.folded_into))
            verdicts.extend(vs)
            new_domains.update(doms)
            if c in stable:
                entry = self._cache[c] = _ClusterCache(key, cn, rows, cy.held.get(c, {}), vs, None, doms,
                                                       cy.hconf.get(c, 0))
                entry.folded = sum(1 for v in vs if v.folded_into)

        self._mark("verdicts")
        # Phase 3: reclaim (gated by first roll-up, capped) and release
        reclaims: list[Action] = []
        n_deferred = 0
        grace = config.reclaim_grace_seconds
        victims_by_cluster: dict[str, set[str]] = {}
        for a in p2_actions:
            if isinstance(a, Drain):
                victims_by_cluster.setdefault(a.cluster_id, set()).add(a.machine_id)
        # (a cached cluster's configured count is fixed while it stays cached, so its drains are
        # keyed on the grace and cap fraction alone; most clusters cost two dict lookups here)
        first, frac, counts, cache = state.first_rollup, config.reclaim_cap_fraction, ix.configured_count, self._cache
        no_excl: set[str] = set()
        for c in sorted(counts):
            if c not in first:
                continue
            excl = victims_by_cluster.get(c, no_excl)
            cc = cache.get(c)
            if cc is not None and not excl and c in by_cluster:
                dr = cc.drains
                if dr is None or dr[0] != (grace, frac):
                    d_list, d_total = _excess(cy, c, grace, _reclaim_cap(counts[c], frac), excl)
                    dr = cc.drains = ((grace, frac), d_list, d_total)
                drains, total = dr[1], dr[2]
            else:
                drains, total = _excess(cy, c, grace, _reclaim_cap(counts[c], frac), excl)
            if total:
                reclaims.extend(drains)
                n_deferred += total - len(drains)
        releases = _releases(cy, now, config)
        self._mark("phase3")

        # Phase 1 actions: per need in precedence order, Idle first then Speculative
        p1_actions: list[Action] = []
        for n in work:
            if not n.acquired_idle and not n.acquired_spec:
                continue
            common = {"machine_id": "", "cluster_id": n.cluster, "need_fingerprint": n.fp, "priority": n.prio,
                      "interruption_penalty_dollars": bucket_dollars(n.ib),
                      "reclamation_penalty_dollars": bucket_dollars(n.rb), "requirements": n.reqs, "group": n.group}
            if n.acquired_idle:
                _fast_each(Configure, n.acquired_idle, {**common, "reason": REASON_IDLE, "kind": "configure"},
                           p1_actions)
            if n.acquired_spec:
                _fast_each(Create, n.acquired_spec, {**common, "reason": REASON_SPECULATIVE, "kind": "create"},
                           p1_actions)
        all_actions: list[Action] = p1_actions + p2_actions + reclaims + releases
        truncated: list[Action] = []
        if config.max_actions_per_cycle > 0 and len(all_actions) > config.max_actions_per_cycle:
            truncated = all_actions[config.max_actions_per_cycle:]
            all_actions = all_actions[: config.max_actions_per_cycle]

        # ledgers: unmet ages, parking, shortfalls
        new_unmet: dict[str, int] = {}
        new_park: dict[str, int] = {}
        short: dict[str, list[_N]] = {}
        n_unsat = n_unresolved = 0
        for n in work:
            unsat = any(n.p1_remaining)
            if n.same is not None and unsat:
                acquired = len(n.acquired_idle) + len(n.acquired_spec)
                if not (acquired > 0 or n.same_sat):
                    new_park[n.park_key] = n.park_age + 1
            if unsat:
                n_unsat += 1
                new_unmet[n.key] = n.unmet_age
            if any(n.remaining):
                short.setdefault(n.fp, []).append(n)
                n_unresolved += 1
        new_short_ages: dict[str, int] = {}
        shortfalls: list[Shortfall] = []
        for fp, ns in short.items():
            age = state.shortfall_ages.get(fp, 0) + 1
            new_short_ages[fp] = age
            deficit = cy.zero
            for n in ns:
                deficit = _add(deficit, n.remaining)
            head = ns[0]
            shortfalls.append(Shortfall(
                fingerprint=fp,
                requirements=head.reqs,
                deficit=_res(dims, deficit),
                priority=head.prio,
                age_cycles=age,
                interruption_bucket=head.ib,
                reason=_unmet_reason(cy, head, True),
                clusters=tuple(sorted({n.cluster for n in ns})),
                escalated=age > config.escalation_after_cycles,
            ))
        shortfalls.sort(key=lambda s: (-s.priority, -s.age_cycles, s.fingerprint))
        shortfalls = shortfalls[: max(0, config.shortfall_report_cap)]

        next_state = EngineState(  # key-sorted so equal states also print (and serialise) identically
            cycle=state.cycle + 1,
            shortfall_ages=dict(sorted(new_short_ages.items())),
            unmet_ages=dict(sorted(new_unmet.items())),
            parking=dict(sorted(new_park.items())),
            same_domains=dict(sorted(new_domains.items())),
            first_rollup=state.first_rollup,
        )
        n_rows = len(work) + sum(len(cc.rows) for cc in cached.values())
        stats = PhaseStats(
            needs_in=n_in,
            needs_normalized=n_rows,
            needs_folded=folded + sum(cc.folded for cc in cached.values()),
            machines=ix.total,
            machine_classes=len(ix.classes),
            credited=sum(n.credited for n in work) + sum(cc.credited for cc in cached.values()),
            bootstraps=sum(len(n.acquired_idle) for n in work),
            provisions=sum(len(n.acquired_spec) for n in work),
            unsatisfied=n_unsat,
            parked=sum(1 for n in work if n.parked),
            preempts=len(p2_actions),
            unresolved=n_unresolved,
            victims_scanned=counters["victims_scanned"],
            reclaims=len(reclaims),
            reclaims_deferred=n_deferred,
            releases=len(releases),
            actions_truncated=len(truncated),
            clusters_recomputed=len(fresh),
            clusters_reused=len(cached),
        )
        mode: Any = "normal"
        suppressed: tuple[Action, ...] = ()
        emitted = tuple(all_actions)
        if config.paused or config.dry_run:
            mode = "paused" if config.paused else "dry_run"
            suppressed, emitted = emitted, ()
        self._mark("ledgers")
        self.last_phase_seconds.pop("_t", None)
        return Decision(
            actions=emitted,
            shortfalls=tuple(shortfalls),
            verdicts=tuple(verdicts),
            stats=stats,
            state=next_state,
            suppressed=suppressed,
            deferred=tuple(truncated),
            mode=mode,
        )


def _reclaim_cap(configured: int, fraction: float) -> int:
    return max(1, math.floor(fraction * configured)) if fraction > 0 else configured


def _still_stable(cc: _ClusterCache, state: EngineState) -> bool:
    """A cached cluster stays valid only if the carried state agrees with what it was built from."""
    parking, domains = state.parking, state.same_domains
    for park_key, age, domain in cc.gangs:
        if parking.get(park_key, 0) != age or domains.get(park_key) != domain:
            return False
    return True


def _by_cluster(needs: Sequence[Need] | NeedsTable) -> dict[str, tuple[Need, ...]]:
    if isinstance(needs, NeedsTable):
        return {c: needs.cluster(c) for c in needs.clusters()}
    out: dict[str, list[Need]] = {}
    for n in needs:
        lst = out.get(n.cluster_id)
        if lst is None:
            out[n.cluster_id] = [n]
        else:
            lst.append(n)
    return {c: tuple(v) for c, v in out.items()}


def decide(needs: Sequence[Need] | NeedsTable, inventory: Any, now_unix_nanos: int, state: EngineState,
           config: EngineConfig, reservations: Mapping[str, str] | None = None) -> Decision:
    """One decision cycle. Pure: same inputs → same output; inputs are never mutated.

    `inventory` is an `Inventory` (or any iterable of `Machine`); `needs` a NeedsTable or a
    sequence of `Need`. `reservations` optionally maps the machine id of an in-flight Create to
    the cluster it is for (the core invariant keeps CREATING/IDLE records cluster-less; without it
    a reservation is matched by need fingerprint alone). Returns the actions, shortfalls,
    per-need verdicts, stats and the next carried state. Use `Engine` for incremental cycles.
    """
    return Engine().decide(needs, inventory, now_unix_nanos, state, config, reservations)


def decide_indexed(needs: Sequence[Need] | NeedsTable, ix: Index, now_unix_nanos: int, state: EngineState,
                   config: EngineConfig, reservations: Mapping[str, str] | None = None) -> Decision:
    """`decide` on a prebuilt machine index (benchmarks use it to time the phases alone)."""
    eng = Engine()
    eng._ix = ix
    return eng._decide(ix, _by_cluster(needs), now_unix_nanos, state, config, reservations or {})


def _matching_supply(cy: _Cycle, n: _N) -> MatchingSupply:
    idle = spec = conf = 0
    for c in cy.eligible(n):
        idle += len(cy.ix.pool.get((IDLE, c.idx), ()))
        spec += len(cy.ix.pool.get((SPEC, c.idx), ()))
        conf += len(cy.ix.configured_by_class.get(c.idx, ()))
    return MatchingSupply(idle=idle, configured=conf, speculative=spec, capped=False)


def _unmet_reason(cy: _Cycle, n: _N, unsat: bool, supply: MatchingSupply | None = None) -> UnmetReason:
    if not unsat:
        return UnmetReason.SATISFIED
    if supply is None:
        supply = _matching_supply(cy, n)
    any_supply = (supply.idle + supply.speculative + supply.configured) > 0
    if n.victims > 0:
        return UnmetReason.PREEMPTION_EXHAUSTED
    if not any_supply:
        return UnmetReason.NO_MATCHING_SUPPLY
    if n.same is not None and not n.same_sat:
        return UnmetReason.TOPOLOGY_UNSATISFIABLE
    return UnmetReason.PRIORITY_STARVED


_NO_SUPPLY = MatchingSupply()


def _verdicts(cy: _Cycle, n: _N, unsat: bool) -> list[Verdict]:
    supply = _matching_supply(cy, n) if unsat else _NO_SUPPLY
    members = n.members
    folded = len(members) > 1 or members[0] is not n.need
    deficit = _res(cy.dims, n.p1_remaining) if unsat else EMPTY
    reason = _unmet_reason(cy, n, unsat, supply) if unsat else UnmetReason.SATISFIED
    freed = _res(cy.dims, n.freed) if n.victims else None
    into = n.fp if folded else ""
    common = {
        "satisfied": not unsat, "deficit": deficit, "claimed_count": len(n.claimed),
        "bootstrap_count": len(n.acquired_idle), "provision_count": len(n.acquired_spec),
        "same_domain": n.same_domain, "same_satisfiable": n.same_sat, "parked": n.parked,
        "parked_age_cycles": n.park_age, "age_cycles_unmet": n.unmet_age if unsat else 0,
        "unmet_reason": reason, "matching_supply": supply, "victims_found": n.victims,
        "capacity_freed": freed, "folded_into": into,
    }
    out = []
    for m in members:
        fields = dict(common)
        fields["cluster_id"] = m.cluster_id
        fields["fingerprint"] = m.profile._fingerprint
        out.append(_fast(Verdict, fields))
    return out


_T = TypeVar("_T")


def _fast_each(cls: type[Any], machines: list[Machine], fields: dict[str, Any], out: list[Any]) -> None:
    """`_fast` for one action per machine, equal but for ``machine_id`` (Phase-1 binds of one need)."""
    new = object.__new__
    for m in machines:
        obj = new(cls)
        d = obj.__dict__
        d.update(fields)
        d["machine_id"] = m.id
        out.append(obj)


def _fast(cls: type[_T], fields: dict[str, Any]) -> _T:
    """Build a frozen dataclass without its per-field ``object.__setattr__`` calls (hot paths emit
    tens of thousands per cycle). `fields` must name every field; equality/hash/repr are unchanged."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj
