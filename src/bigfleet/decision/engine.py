"""`decide()`: one deterministic decision cycle (normalise → Phase 1 → Phase 2 → Phase 3 → ledgers).

Single-threaded and sequential in a total precedence order, which gives exactly the outcome the
upstream optimistic-concurrency engine promises ("as if one pass in priority order") without its
nondeterminism. See docs/decision-engine.md for the rules and every deliberate deviation.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from bigfleet.machine.record import Machine
from bigfleet.machine.state import CapacityType
from bigfleet.needs import Need, NeedsTable, Operator, Profile, Requirement, Resources, TopologySpread
from bigfleet.needs.penalty import bucket_dollars, penalty_sort_key

from .index import (
    CONFIGURED,
    CONFIGURING,
    IDLE,
    SPEC,
    Index,
    MClass,
    build_index,
    m_interruption,
    m_reclamation,
)
from .types import (
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
        "same",
        "same_domain",
        "same_sat",
        "spread",
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
        self.same: Requirement | None = p.same
        self.spread: TopologySpread | None = p.strict_spread
        self.agg: Vec = tuple(need.aggregate_resources.get(d) for d in dims)
        self.minu: Vec = tuple(need.min_unit.get(d) for d in dims)
        self.arrival = need.arrival_unix_nanos
        self.order = (-self.prio, -penalty_sort_key(self.ib), -penalty_sort_key(self.rb), self.arrival,
                      self.cluster, self.fp)
        self.key = self.cluster + "\x00" + self.fp
        self.park_key = self.cluster + "\x00" + self.group + "\x00" + self.fp
        self.parked = False
        self.park_age = 0
        self.remaining: Vec = self.agg
        self.p1_remaining: Vec = self.agg
        self.claimed: list[Machine] = []
        self.credited = 0
        self.acquired_idle: list[Machine] = []
        self.acquired_spec: list[Machine] = []
        self.same_domain = ""
        self.same_sat = False
        self.victims = 0
        self.freed: Vec = tuple(0 for _ in dims)
        self.unmet_age = 0


class _Cycle:
    """Mutable scratch state of one `decide` call (never escapes it)."""

    def __init__(self, ix: Index, dims: tuple[str, ...]) -> None:
        self.ix = ix
        self.dims = dims
        self.alloc: list[Vec] = [tuple(c.alloc.get(d) for d in dims) for c in ix.classes]
        self.claim: dict[str, _N] = {}
        self.cursor: dict[tuple[int, int], int] = {}
        self.taken: dict[tuple[int, int], int] = {}
        self.vused: dict[tuple[int, int], int] = {}
        self.zero: Vec = tuple(0 for _ in dims)
        self._eligible: dict[tuple[tuple[Requirement, ...], Vec], list[MClass]] = {}
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


def normalize(needs: Sequence[Need], ix: Index) -> tuple[list[tuple[Need, list[Need]]], int]:
    """Fold Same needs whose whole aggregate fits on one machine into plain needs.

    A gang that fits on one machine cannot be split across domains, so co-location is automatic;
    folding keeps the machine-exclusive claim ledger honest (two sub-machine gangs share one
    machine instead of each claiming one). A gang is foldable when some machine matching its
    profile covers the whole aggregate: one of its own cluster's bound machines, or any Idle or
    Speculative machine. Returns (need, original members) rows and the count of folded gangs.
    """
    out: list[tuple[Need, list[Need]]] = []
    groups: dict[tuple[str, str, Resources], list[Need]] = {}
    stripped: dict[tuple[str, str, Resources], Profile] = {}
    strip_memo: dict[tuple[Any, ...], Profile] = {}
    free_classes = {ci for (st, ci) in ix.pool}
    own_memo: dict[str, set[int]] = {}
    memo: dict[tuple[str, tuple[Requirement, ...], Resources], bool] = {}
    folded = 0
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
            for c in ix.matched_classes(p.requirements):
                if (c.idx in free_classes or c.idx in own_classes) and agg.fits_in(c.alloc):
                    ok = True
                    break
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
    return out, folded


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
        got = [(c, by_class[c.idx]) for c in cy.eligible(n) if c.idx in by_class]
        got.sort(key=lambda t: (t[0].price, t[0].idx))
        cy._bound[k] = got
    return got


def _keep_stream(cy: _Cycle, lists: list[tuple[MClass, list[Machine]]]) -> Iterable[tuple[MClass, Machine]]:
    """Bound machines in keep order: price asc, reclamation desc, id asc; claimed ones skipped."""
    claim = cy.claim
    if len(lists) == 1:
        c, lst = lists[0]
        for m in lst:
            if m.id not in claim:
                yield c, m
        return
    items = [(c.price, -m_reclamation(m), m.id, c, m) for c, lst in lists for m in lst if m.id not in claim]
    items.sort(key=lambda t: (t[0], t[1], t[2]))
    for t in items:
        if t[4].id not in claim:
            yield t[3], t[4]


def _credit_plain(cy: _Cycle, n: _N) -> None:
    for state in (CONFIGURED, CONFIGURING):
        if not any(n.remaining):
            return
        for c, m in _keep_stream(cy, _bound_lists(cy, n, state)):
            if not any(n.remaining):
                return
            cy.take(m, n, None)
            n.credited += 1
            n.remaining = _sub(n.remaining, cy.alloc[c.idx])
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
            owner = ix.reserved_for.get(m.id, "")
            if owner and owner != n.cluster:
                continue
            c = ix.cls(m)
            if not _covers(cy.alloc[c.idx], n.minu) or not all(r.matches(c.attrs) for r in n.reqs):
                continue
            if domain is not None and n.same is not None and c.attrs.get(n.same.key) != domain:
                continue
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
        for c, m in _keep_stream(cy, _bound_lists(cy, n, state)):
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
        cy.take(m, n, None)
        n.credited += 1
        n.remaining = _sub(n.remaining, alloc[c.idx])
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
    """Classes with supply in `state`, grouped by equal effective cost, cheapest group first."""
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
    """The next unclaimed machine of a group of equal-cost classes: reclamation asc, then id."""
    best: tuple[MClass, Machine] | None = None
    best_k: tuple[float, str] = (0.0, "")
    for c in group:
        m = cy.head((state, c.idx))
        if m is None:
            continue
        k = (m_reclamation(m), m.id)
        if best is None or k < best_k:
            best, best_k = (c, m), k
    return best


def _acquire(cy: _Cycle, n: _N, classes: list[MClass], penalty: float) -> None:
    for state in (IDLE, SPEC):
        for group in _ordered_classes(cy, classes, state, penalty):
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
    sp = n.spread
    assert sp is not None
    key = sp.topology_key
    skew = max(1, int(sp.max_skew))
    counts: dict[str, int] = {}
    for m in n.claimed:
        v = cy.ix.cls(m).attrs.get(key)
        if v is not None:
            counts[v] = counts.get(v, 0) + 1
    for state in (IDLE, SPEC):
        by_dom: dict[str, list[MClass]] = {}
        for c in classes:
            v = c.attrs.get(key)
            if v is not None and (state, c.idx) in cy.ix.pool:
                by_dom.setdefault(v, []).append(c)
        for v in by_dom:
            counts.setdefault(v, 0)
        groups = {v: _ordered_classes(cy, cl, state, penalty) for v, cl in by_dom.items()}
        while any(n.remaining) and counts:
            lo = min(counts.values())
            pick: tuple[float, str, MClass, Machine] | None = None
            for v in sorted(groups):
                if counts[v] > lo + skew - 1:
                    continue
                for g in groups[v]:
                    nxt = _next_in_group(cy, state, g)
                    if nxt is not None:
                        cand = (nxt[0].eff_cost(penalty), v, nxt[0], nxt[1])
                        if pick is None or (cand[0], cand[1]) < (pick[0], pick[1]):
                            pick = cand
                        break
            if pick is None:
                break
            _, v, c, m = pick
            cy.take(m, n, (state, c.idx))
            (n.acquired_idle if state == IDLE else n.acquired_spec).append(m)
            n.remaining = _sub(n.remaining, cy.alloc[c.idx])
            counts[v] += 1


def _phase1(cy: _Cycle, rows: list[_N], state: EngineState) -> None:
    # Pass 1: credit bound supply (and in-flight reservations) in precedence order.
    for n in rows:
        if n.same is not None:
            _credit_same(cy, n, state.same_domains.get(n.park_key))
        else:
            _credit_plain(cy, n)
    # Pass 2: acquire Idle then Speculative for what is left, in the same order.
    for n in rows:
        if not any(n.remaining) or n.parked:
            continue
        penalty = bucket_dollars(n.ib)
        classes = cy.eligible(n)
        if n.same is not None:
            if not n.same_domain:
                continue
            dom = n.same_domain
            classes = [c for c in classes if c.attrs.get(n.same.key) == dom]
            _acquire(cy, n, classes, penalty)
        elif n.spread is not None:
            _acquire_spread(cy, n, classes, penalty)
        else:
            _acquire(cy, n, classes, penalty)


# --------------------------------------------------------------------------------------------
# Phase 2
# --------------------------------------------------------------------------------------------


def _victim_key(m: Machine) -> tuple[float, int, str]:
    return (victim_score(m_interruption(m), m_reclamation(m), 0.0, m.shape.price_per_hour),
            m.assignment.priority, m.id)


class _VictimIndex:
    """Configured machines per class sorted by victim score (built lazily, per cycle)."""

    def __init__(self, ix: Index) -> None:
        self.ix = ix
        self.sorted: dict[int, list[Machine]] = {}
        self.min_prio: dict[int, int] = {}

    def lists(self, ci: int) -> list[Machine]:
        got = self.sorted.get(ci)
        if got is None:
            got = sorted(self.ix.configured_by_class.get(ci, ()), key=_victim_key)
            self.sorted[ci] = got
            self.min_prio[ci] = min((m.assignment.priority for m in got), default=2**31)
        return got


def _phase2(cy: _Cycle, rows: list[_N], config: EngineConfig, stats: dict[str, int]) -> tuple[list[Action], set[str]]:
    actions: list[Action] = []
    victims: set[str] = set()
    vi = _VictimIndex(cy.ix)
    for n in rows:
        if not any(n.remaining) or n.parked or n.unmet_age < config.preempt_after_cycles:
            continue
        if n.same is not None and not n.same_domain:
            continue
        classes = [c for c in cy.eligible(n) if c.idx in cy.ix.configured_by_class]
        if n.same is not None:
            classes = [c for c in classes if c.attrs.get(n.same.key) == n.same_domain]
        lists = []
        for c in classes:
            lst = vi.lists(c.idx)
            if vi.min_prio[c.idx] < n.prio:
                lists.append((c, lst))
        if not lists:
            continue
        if len(lists) == 1:
            stream: Iterable[Machine] = lists[0][1]
        else:
            import heapq

            stream = heapq.merge(*(lst for _, lst in lists), key=_victim_key)
        for m in stream:
            if not any(n.remaining):
                break
            stats["victims_scanned"] += 1
            if m.id in victims:
                continue
            holder = cy.claim.get(m.id)
            vprio = m.assignment.priority
            if holder is not None:
                if holder is n:
                    continue
                vprio = max(vprio, holder.prio)
            if vprio >= n.prio or math.isinf(m_interruption(m)):
                continue
            victims.add(m.id)
            c = cy.ix.cls(m)
            n.victims += 1
            n.freed = _add(n.freed, cy.alloc[c.idx])
            n.remaining = _sub(n.remaining, cy.alloc[c.idx])
            actions.append(Drain(m.id, m.cluster, drain_grace_seconds(n.prio, vprio), n.prio, "preempt"))
    return actions, victims


# --------------------------------------------------------------------------------------------
# Phase 3
# --------------------------------------------------------------------------------------------


def _reclaim_key(m: Machine) -> tuple[float, float, str]:
    # cheapest to lose first: lowest reclamation penalty, then the most expensive, then id
    return (m_reclamation(m), -m.shape.price_per_hour, m.id)


def _phase3(cy: _Cycle, state: EngineState, victims: set[str], now: int, config: EngineConfig
            ) -> tuple[list[Action], list[Action], list[Action]]:
    reclaims: list[Action] = []
    deferred: list[Action] = []
    ix = cy.ix
    for cluster in sorted(ix.configured_count):
        if cluster not in state.first_rollup:
            continue
        by_class = ix.bound.get(cluster, {}).get(CONFIGURED, {})
        excess = [m for lst in by_class.values() for m in lst if m.id not in cy.claim and m.id not in victims]
        if not excess:
            continue
        excess.sort(key=_reclaim_key)
        cap = len(excess)
        if config.reclaim_cap_fraction > 0:
            cap = max(1, math.floor(config.reclaim_cap_fraction * ix.configured_count[cluster]))
        for i, m in enumerate(excess):
            a = Drain(m.id, cluster, config.reclaim_grace_seconds, 0, "reclaim")
            (reclaims if i < cap else deferred).append(a)
    releases: list[Action] = []
    holds = ((int(CapacityType.ON_DEMAND), config.on_demand_hold_seconds),
             (int(CapacityType.SPOT), config.spot_hold_seconds))
    rel: list[str] = []
    for ctype, hold in holds:
        if hold is None or hold <= 0:
            continue
        limit = now - hold * 1_000_000_000
        for m in ix.idle_by_type.get(ctype, ()):
            if m.state_since_unix_nanos <= limit and m.id not in cy.claim:
                rel.append(m.id)
    rel.sort()
    releases = [Delete(mid) for mid in rel]
    return reclaims, deferred, releases


# --------------------------------------------------------------------------------------------
# decide
# --------------------------------------------------------------------------------------------


def _needs_of(needs: Sequence[Need] | NeedsTable) -> Sequence[Need]:
    if isinstance(needs, NeedsTable):
        return needs.snapshot()
    return needs


def _machines_of(inventory: Any) -> Iterable[Machine]:
    if hasattr(inventory, "machines"):
        ms: Iterable[Machine] = inventory.machines()
        return ms
    it: Iterable[Machine] = inventory
    return it


def _res(dims: tuple[str, ...], v: Vec) -> Resources:
    return Resources.from_milli({d: x for d, x in zip(dims, v, strict=True) if x})


def decide(needs: Sequence[Need] | NeedsTable, inventory: Any, now_unix_nanos: int, state: EngineState,
           config: EngineConfig, reservations: Mapping[str, str] | None = None) -> Decision:
    """One decision cycle. Pure: same inputs → same output; inputs are never mutated.

    `inventory` is an `Inventory` (or any iterable of `Machine`). `needs` is a NeedsTable or its
    snapshot. `reservations` optionally maps an in-flight Create's machine id to its cluster (see
    `build_index`). Returns the actions to execute, shortfalls, per-need verdicts, stats and the
    next state.
    """
    ix = build_index(_machines_of(inventory), reservations)
    return decide_indexed(_needs_of(needs), ix, now_unix_nanos, state, config)


def decide_indexed(needs: Sequence[Need], ix: Index, now: int, state: EngineState, config: EngineConfig
                   ) -> Decision:
    """`decide` on a prebuilt machine index (the index is read-only here and may be reused)."""
    rows_raw, folded = normalize(needs, ix)
    dim_set: set[str] = set()
    for nd, _ in rows_raw:
        dim_set.update(nd.aggregate_resources.names())
        dim_set.update(nd.min_unit.names())
    dims = tuple(sorted(dim_set))
    cy = _Cycle(ix, dims)
    rows = [_N(nd, members, dims) for nd, members in rows_raw]
    rows.sort(key=lambda r: r.order)

    # parking stamp (Same needs only)
    for n in rows:
        if n.same is not None:
            age = state.parking.get(n.park_key, 0)
            n.park_age = age
            n.parked = age >= config.park_after_cycles and (
                config.reprobe_every_cycles <= 0 or age % config.reprobe_every_cycles != 0)

    _phase1(cy, rows, state)

    for n in rows:
        n.p1_remaining = n.remaining
        if any(n.remaining):
            n.unmet_age = state.unmet_ages.get(n.key, 0) + 1

    counters = {"victims_scanned": 0}
    p2_actions, victims = _phase2(cy, rows, config, counters)
    reclaims, deferred_reclaims, releases = _phase3(cy, state, victims, now, config)

    # Phase 1 actions: per need in precedence order, Idle first then Speculative
    p1_actions: list[Action] = []
    for n in rows:
        ipd = bucket_dollars(n.ib)
        rpd = bucket_dollars(n.rb)
        for m in n.acquired_idle:
            p1_actions.append(Configure(m.id, n.cluster, n.fp, n.prio, ipd, rpd, n.reqs, n.group, REASON_IDLE))
        for m in n.acquired_spec:
            p1_actions.append(Create(m.id, n.cluster, n.fp, n.prio, ipd, rpd, n.reqs, n.group, REASON_SPECULATIVE))

    all_actions: list[Action] = p1_actions + p2_actions + reclaims + releases
    truncated: list[Action] = []
    if config.max_actions_per_cycle > 0 and len(all_actions) > config.max_actions_per_cycle:
        truncated = all_actions[config.max_actions_per_cycle:]
        all_actions = all_actions[: config.max_actions_per_cycle]

    # verdicts, ledgers, shortfalls
    verdicts: list[Verdict] = []
    new_unmet: dict[str, int] = {}
    new_park: dict[str, int] = {}
    new_domains: dict[str, str] = {}
    short: dict[str, list[_N]] = {}
    n_unsat = 0
    n_unresolved = 0
    for n in rows:
        unsat = any(n.p1_remaining)
        if n.same is not None and n.same_domain:
            new_domains[n.park_key] = n.same_domain
        if n.same is not None:
            acquired = len(n.acquired_idle) + len(n.acquired_spec)
            if unsat and not (acquired > 0 or n.same_sat):
                new_park[n.park_key] = n.park_age + 1
        if unsat:
            n_unsat += 1
            new_unmet[n.key] = n.unmet_age
        if any(n.remaining):
            # still short after Phase 2's preemptions: a shortfall
            short.setdefault(n.fp, []).append(n)
            n_unresolved += 1
        verdicts.extend(_verdicts(cy, n, unsat))
    verdicts.sort(key=lambda v: (v.cluster_id, v.fingerprint, v.folded_into))

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

    next_state = EngineState(
        cycle=state.cycle + 1,
        shortfall_ages=new_short_ages,
        unmet_ages=new_unmet,
        parking=new_park,
        same_domains=new_domains,
        first_rollup=state.first_rollup,
    )
    stats = PhaseStats(
        needs_in=len(needs),
        needs_normalized=len(rows),
        needs_folded=folded,
        machines=ix.total,
        machine_classes=len(ix.classes),
        credited=sum(n.credited for n in rows),
        bootstraps=sum(1 for a in p1_actions if isinstance(a, Configure)),
        provisions=sum(1 for a in p1_actions if isinstance(a, Create)),
        unsatisfied=n_unsat,
        parked=sum(1 for n in rows if n.parked),
        preempts=len(p2_actions),
        unresolved=n_unresolved,
        victims_scanned=counters["victims_scanned"],
        reclaims=len(reclaims),
        reclaims_deferred=len(deferred_reclaims),
        releases=len(releases),
        actions_truncated=len(truncated),
    )
    mode: Any = "normal"
    suppressed: tuple[Action, ...] = ()
    emitted = tuple(all_actions)
    if config.paused or config.dry_run:
        mode = "paused" if config.paused else "dry_run"
        suppressed, emitted = emitted, ()
    return Decision(
        actions=emitted,
        shortfalls=tuple(shortfalls),
        verdicts=tuple(verdicts),
        stats=stats,
        state=next_state,
        suppressed=suppressed,
        deferred=tuple(deferred_reclaims) + tuple(truncated),
        mode=mode,
    )


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


def _verdicts(cy: _Cycle, n: _N, unsat: bool) -> list[Verdict]:
    supply = _matching_supply(cy, n) if unsat else MatchingSupply()
    folded = len(n.members) > 1 or (n.members and n.members[0] is not n.need)
    base = dict(
        satisfied=not unsat,
        deficit=_res(cy.dims, n.p1_remaining),
        claimed_count=len(n.claimed),
        bootstrap_count=len(n.acquired_idle),
        provision_count=len(n.acquired_spec),
        same_domain=n.same_domain,
        same_satisfiable=n.same_sat,
        parked=n.parked,
        parked_age_cycles=n.park_age,
        age_cycles_unmet=n.unmet_age if unsat else 0,
        unmet_reason=_unmet_reason(cy, n, unsat, supply),
        matching_supply=supply,
        victims_found=n.victims,
        capacity_freed=_res(cy.dims, n.freed) if n.victims else None,
    )
    return [Verdict(cluster_id=m.cluster_id, fingerprint=m.fingerprint, folded_into=n.fp if folded else "",
                    **base)  # type: ignore[arg-type]
            for m in n.members]
