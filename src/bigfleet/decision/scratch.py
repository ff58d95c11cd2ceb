"""The per-need row and the per-cycle scratch state that every phase reads and writes.

Neither escapes one `decide` call; a cached cluster keeps its rows, never the scratch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from bigfleet.machine.record import Machine
from bigfleet.machine.state import MachineState
from bigfleet.needs import Need, Operator, Profile, Requirement, Resources, TopologySpread

from .index import (
    Index,
    MClass,
)
from .types import MatchingSupply
from .vec import Vec, covers, units_to_cover

if TYPE_CHECKING:
    from .same_domain import DomainFree, FreeRanking

MACHINE_ID = attrgetter("id")

#: what `CycleScratch.units` answers when no number of machines covers the demand
UNBOUNDED = 1 << 62


RECLAMATION_STAMP = attrgetter("assignment.reclamation_penalty_dollars")


CONFIGURED_STATE = MachineState.CONFIGURED


class NeedRow:
    """One (normalised) need being decided, plus its per-cycle results."""

    __slots__ = (
        "acquired_idle",
        "acquired_spec",
        "agg",
        "arrival",
        "claimed",
        "cluster",
        "conf_credited",
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

    def __init__(self, need: Need, members: list[Need], info: ProfileInfo, agg: Vec, minu: Vec, zero: Vec,
                 arrival_key: str) -> None:
        fp, self.reqs, self.prio, self.ib, self.rb, group, self.same, self.spreads, order_prefix = info
        self.need = need
        self.members = members
        c = self.cluster = need.cluster_id
        self.fp = fp
        self.group = group
        self.agg = agg
        self.minu = minu
        self.arrival = need.arrival_unix_nanos
        key = self.key = f"{c}\x00{fp}"
        #: precedence as one string (priority desc, buckets desc, arrival, cluster, fingerprint): a
        #: cycle sorts tens of thousands of rows, and strings compare in C where tuples do not
        self.order = f"{order_prefix}{arrival_key}{key}"
        #: (read for Same rows only: parking and sticky domains are per gang)
        self.park_key = "" if self.same is None else c + "\x00" + group + "\x00" + fp
        self.parked = False
        self.park_age = 0
        self.remaining = agg
        self.p1_remaining = agg
        self.reserved_credit = False
        self.claimed: list[Machine] = []
        self.credited = 0
        #: of `claimed`, the Configured machines (credited in Phase 1; nothing else claims one)
        self.conf_credited = 0
        self.acquired_idle: list[Machine] = []
        self.acquired_spec: list[Machine] = []
        self.same_domain = ""
        self.same_sat = False
        self.victims = 0
        self.freed = zero
        self.unmet_age = 0


#: what a row takes from its profile: (fingerprint, requirements, priority, interruption bucket,
#: reclamation bucket, group, Same requirement, strict spreads, then its part of the order key)
ProfileInfo = tuple[str, tuple[Requirement, ...], int, int, int, str, Requirement | None,
                    tuple[TopologySpread, ...], str]

_INT64 = 1 << 63


def ordered_int(x: int) -> str:
    """`x` as a string that sorts as the int does: nine characters within int64 (what the wire
    carries), longer but still ordered beyond it. Concatenated fields stay ordered field by field."""
    if -_INT64 <= x < _INT64:
        return "\x01" + (x + _INT64).to_bytes(8, "big").decode("latin-1")
    mag = abs(x).to_bytes((abs(x).bit_length() + 7) // 8, "big").decode("latin-1")
    if x > 0:  # (a longer magnitude is larger; the length leads)
        return "\x02" + chr(len(mag)) + mag
    return "\x00" + chr(0xFFFF - len(mag)) + "".join(chr(255 - ord(ch)) for ch in mag)


def profile_info(p: Profile) -> ProfileInfo:
    """Everything a row derives from its profile alone (needs of many clusters share few profiles)."""
    same: Requirement | None = None
    for r in p.requirements:
        if r.operator is Operator.SAME:
            same = r
            break
    prio, ib, rb = int(p.priority), int(p.interruption_bucket), int(p.reclamation_bucket)
    #: every DoNotSchedule spread term (a gang's Same supersedes them)
    spreads = tuple(s for s in p.spread if s.strict) if same is None else ()
    prefix = ordered_int(-prio) + ordered_int(-(ib if ib > 1 else 1)) + ordered_int(-(rb if rb > 1 else 1))
    return (p.fingerprint(), p.requirements, prio, ib, rb, p.group, same, spreads, prefix)


class RowMaker:
    """Builds a cycle's `NeedRow`s: profile-derived fields once per fingerprint and resource vectors
    once per distinct vector, so a row costs its own few fields, not its profile's."""

    def __init__(self, dims: tuple[str, ...]) -> None:
        self.dims = dims
        self.zero: Vec = tuple([0] * len(dims))
        self.infos: dict[str, ProfileInfo] = {}
        self.vecs: dict[tuple[tuple[str, int], ...], Vec] = {}
        #: arrival → its order-key part (the needs of one roll-up share an arrival)
        self.arrivals: dict[int, str] = {}

    def info(self, p: Profile) -> ProfileInfo:
        got = self.infos.get(p._fingerprint)
        if got is None:
            got = self.infos[p._fingerprint] = profile_info(p)
        return got

    def same_of(self, p: Profile) -> Requirement | None:
        return self.info(p)[6]

    def vec(self, r: Resources) -> Vec:
        items = r._items
        got = self.vecs.get(items)
        if got is None:
            m = r._map
            got = self.vecs[items] = tuple([m.get(d, 0) for d in self.dims])
        return got

    def rows(self, raw: list[tuple[Need, list[Need]]]) -> list[NeedRow]:
        return [self.row(nd, members, self.info(nd.profile)) for nd, members in raw]

    def row(self, nd: Need, members: list[Need], info: ProfileInfo) -> NeedRow:
        return NeedRow(nd, members, info, self.vec(nd.aggregate_resources), self.vec(nd.min_unit), self.zero,
                       self.arrival_key(nd.arrival_unix_nanos))

    def arrival_key(self, arrival: int) -> str:
        got = self.arrivals.get(arrival)
        if got is None:
            got = self.arrivals[arrival] = ordered_int(arrival)
        return got

    def plain_rows(self, needs: Sequence[Need]) -> list[NeedRow] | None:
        """One row per need (no folding), or None when some need has a Same requirement (its
        cluster is normalised first): the per-need loop inlined, profiles looked up in the same pass."""
        infos, info_of, vecs, vec, zero, arrivals = self.infos, self.info, self.vecs, self.vec, self.zero, self.arrivals
        out = []
        for nd in needs:
            p = nd.profile
            info = infos.get(p._fingerprint)
            if info is None:
                info = info_of(p)
            if info[6] is not None:
                return None
            agg, minu = nd.aggregate_resources, nd.min_unit
            a = vecs.get(agg._items)
            if a is None:
                a = vec(agg)
            mu = vecs.get(minu._items)
            if mu is None:
                mu = vec(minu)
            at = nd.arrival_unix_nanos
            ak = arrivals.get(at)
            if ak is None:
                ak = arrivals[at] = ordered_int(at)
            out.append(NeedRow(nd, [nd], info, a, mu, zero, ak))
        return out


class ClusterHeld:
    """A cluster's held bound machines: id → the need holding it.

    Bulk credits are kept as (need, machines) runs and filed into the id map on the first read. Most
    clusters of a steady fleet are exactly met: nothing preempts from or reclaims in them, so nobody
    asks, and a cold cycle does not build a dict entry per machine of the fleet (~8 % of it at
    aggregated-500k). A cached cluster keeps this object, so a later read files the runs once."""

    __slots__ = ("_ids", "_runs")

    def __init__(self) -> None:
        self._ids: dict[str, NeedRow] = {}
        self._runs: list[tuple[NeedRow, list[Machine]]] = []

    def add_run(self, n: NeedRow, ms: list[Machine]) -> None:
        """`ms` (a list nobody mutates) is held by `n`; the caller knows none of it is held yet."""
        self._runs.append((n, ms))

    @property
    def pending(self) -> int:
        """Runs not filed yet."""
        return len(self._runs)

    def ids(self) -> dict[str, NeedRow]:
        """The id map, every run filed (callers may write to it)."""
        if self._runs:
            ids = self._ids
            for n, ms in self._runs:
                ids.update(zip(map(MACHINE_ID, ms), repeat(n)))
            self._runs.clear()
        return self._ids


class CycleScratch:
    """Mutable scratch state of one `decide` call (never escapes it)."""

    def __init__(self, ix: Index, dims: tuple[str, ...], reservations: Mapping[str, str], cycle: int = 0) -> None:
        self.ix = ix
        self.dims = dims
        self.reservations = reservations
        #: the cycle the decision's state will carry (what verdicts count unmet streaks against)
        self.cycle = cycle
        self.alloc: list[Vec] = [tuple(c.alloc.get(d) for d in dims) for c in ix.classes]
        #: claims on pool (Idle/Speculative) and Creating machines
        self.claim: dict[str, NeedRow] = {}
        #: cluster → claims on its bound (Configured/Configuring) machines
        self.held: dict[str, ClusterHeld] = {}
        self.bcur: dict[tuple[str, int, int], int] = {}
        #: cluster → how many of its CONFIGURED machines are held
        self.hconf: dict[str, int] = {}
        self.cursor: dict[tuple[int, int], int] = {}
        self.taken: dict[tuple[int, int], int] = {}
        self.vused: dict[tuple[int, int], int] = {}
        #: class idx → bumped whenever `taken` or `vused` of its pools changes (domain supply memo)
        self.pool_ver: dict[int, int] = {}
        #: id(domain class list) → its free supply as of its classes' pool versions
        self.domain_free: dict[int, DomainFree] = {}
        #: (id(domain list), deficit) → its free-only candidates in order (see `FreeRanking`)
        self.free_rankings: dict[tuple[int, Vec], FreeRanking] = {}
        #: DRAINING machines already counted against some need's deficit this cycle (Phase 2)
        self.awaited: set[str] = set()
        self.zero: Vec = tuple(0 for _ in dims)
        self._eligible: dict[tuple[tuple[Requirement, ...], Vec], list[MClass]] = {}
        self._eligible_fp: dict[tuple[str, Vec], list[MClass]] = {}
        #: keyed by id() of the eligible list (which `_eligible` holds for the whole cycle)
        self._eligible_set: dict[int, set[int]] = {}
        # Caches keyed by id() of a list also hold that list, so the id cannot be reused by another
        # object while the entry exists (a hit is also checked by identity).
        self.ordered_groups: dict[tuple[int, int, float], tuple[list[MClass], list[list[MClass]]]] = {}
        self.group_heaps: dict[tuple[int, int], tuple[list[MClass], list[tuple[float, str, int]]]] = {}
        #: Phase-1 credit: fingerprint → (MinUnit, eligible class set); (cluster, id(that set)) → plan
        self.fp_eligible: dict[str, tuple[Vec, set[int]]] = {}
        self.credit_plans: dict[tuple[str, int], Any] = {}
        #: id(eligible class set) → whether its classes share one allocatable
        self.one_alloc: dict[int, bool] = {}
        #: (state, a cluster's classes in its bound map's order) → id(eligible set) → what credit selects
        self.selections: dict[tuple[int, tuple[int, ...]], dict[int, tuple[set[int], list[int] | None]]] = {}
        #: (remaining demand, allocatable) → machines it takes to cover it (`units_to_cover`, no limit)
        self.units_memo: dict[tuple[Vec, Vec], int] = {}
        #: (cluster, bound state) → its bound classes in keep order (None: some class has several stamps)
        self.keep_orders: dict[tuple[str, int], Any] = {}
        self.merged_keep_order: dict[int, tuple[Any, list[tuple[MClass, Machine]]]] = {}
        self.mcur: dict[int, int] = {}
        self._domains: dict[tuple[int, str], list[tuple[str, list[MClass]]]] = {}
        self.supply_memo: dict[int, tuple[list[MClass], MatchingSupply]] = {}
        #: deficit vector → its `Resources` (verdicts share one record per distinct deficit)
        self.resources_memo: dict[Vec, Resources] = {}
        self._price_rank: list[int] | None = None
        self._class_rank: list[int] | None = None
        self._class_prices: list[float] | None = None
        self._keep_rank: list[int] | None = None
        self._alloc_group: list[int] | None = None
        #: (cluster, state, id(eligible class list)) → `credit.bound_lists`
        self.bound_lists_memo: dict[tuple[str, int, int], list[tuple[MClass, list[Machine]]]] = {}

    def held_in(self, cluster: str) -> ClusterHeld:
        h = self.held.get(cluster)
        if h is None:
            h = self.held[cluster] = ClusterHeld()
        return h

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

    def units(self, rem: Vec, unit: Vec) -> int:
        """Machines of allocatable `unit` it takes to cover `rem` (`UNBOUNDED` when none can), memoised
        per pair: rows of many clusters ask the same. Callers clamp to what they have."""
        k = self.units_memo.get((rem, unit))
        if k is None:
            k = self.units_memo[(rem, unit)] = units_to_cover(rem, unit, UNBOUNDED)
        return k

    def available(self, key: tuple[int, int]) -> int:
        lst = self.ix.pool.get(key)
        if not lst:
            return 0
        return len(lst) - self.taken.get(key, 0) - self.vused.get(key, 0)

    def take(self, m: Machine, n: NeedRow, key: tuple[int, int] | None) -> None:
        self.claim[m.id] = n
        n.claimed.append(m)
        if key is not None:
            self.taken[key] = self.taken.get(key, 0) + 1
            self.pool_ver[key[1]] = self.pool_ver.get(key[1], 0) + 1

    def eligible(self, n: NeedRow) -> list[MClass]:
        """Classes matching the need's requirements whose allocatable covers its MinUnit (cached).

        Looked up by (fingerprint, MinUnit) first: a fingerprint determines the requirements, and
        hashing a string is cheap where hashing a requirement tuple is a Python call per requirement.
        The list itself is shared by every need with equal requirements (callers cache by its id)."""
        got = self._eligible_fp.get((n.fp, n.minu))
        if got is not None:
            return got
        k = (n.reqs, n.minu)
        got = self._eligible.get(k)
        if got is None:
            alloc = self.alloc
            minu = n.minu
            got = [c for c in self.ix.matched_classes(n.reqs) if covers(alloc[c.idx], minu)]
            self._eligible[k] = got
        self._eligible_fp[(n.fp, n.minu)] = got
        return got

    def price_rank(self) -> list[int]:
        """class idx → its position in (price, idx) order (a C-level sort key for class lists)."""
        if self._price_rank is None:
            classes = self.ix.classes
            rank = [0] * len(classes)
            for pos, c in enumerate(sorted(classes, key=lambda c: (c.price, c.idx))):
                rank[c.idx] = pos
            self._price_rank = rank
        return self._price_rank

    def class_rank(self) -> list[int]:
        """class idx → its position in `MClass.sort_key` order (classes added since the cold build
        are numbered after it, so the idx alone is not that order)."""
        if self._class_rank is None:
            classes = self.ix.classes
            rank = [0] * len(classes)
            for pos, c in enumerate(sorted(classes, key=lambda c: c.sort_key)):
                rank[c.idx] = pos
            self._class_rank = rank
        return self._class_rank

    def class_prices(self) -> list[float]:
        """class idx → its price (a C-level sort key)."""
        if self._class_prices is None:
            self._class_prices = [c.price for c in self.ix.classes]
        return self._class_prices

    def keep_rank(self) -> list[int]:
        """class idx → its position in (price, `class_rank`) order: the keep order of classes whose
        machines all carry one reclamation stamp."""
        if self._keep_rank is None:
            prices, crank = self.class_prices(), self.class_rank()
            rank = [0] * len(prices)
            for pos, ci in enumerate(sorted(range(len(prices)), key=lambda ci: (prices[ci], crank[ci]))):
                rank[ci] = pos
            self._keep_rank = rank
        return self._keep_rank

    def alloc_group(self) -> list[int]:
        """class idx → a number shared by exactly the classes of equal allocatable (int compares)."""
        if self._alloc_group is None:
            seen: dict[Vec, int] = {}
            self._alloc_group = [seen.setdefault(a, len(seen)) for a in self.alloc]
        return self._alloc_group

    def eligible_set(self, n: NeedRow) -> set[int]:
        classes = self.eligible(n)
        got = self._eligible_set.get(id(classes))
        if got is None:
            got = self._eligible_set[id(classes)] = {c.idx for c in classes}
        return got

    def domains(self, n: NeedRow, key: str) -> list[tuple[str, list[MClass]]]:
        """Eligible classes grouped by their value of `key` (classes without the key dropped)."""
        classes = self.eligible(n)
        k = (id(classes), key)  # (the eligible list lives as long as the scratch: its id is stable)
        got = self._domains.get(k)
        if got is None:
            by: dict[str, list[MClass]] = {}
            for c in classes:
                v = c.attrs.get(key)
                if v is not None:
                    by.setdefault(v, []).append(c)
            got = [(v, sorted(cl, key=lambda c: c.sort_key)) for v, cl in sorted(by.items())]
            self._domains[k] = got
        return got
