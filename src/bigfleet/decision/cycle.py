"""One decision cycle (normalise → Phase 1 → Phase 2 → Phase 3 → ledgers) and the `Engine` that
keeps the machine index and per-cluster results between cycles.

Single-threaded and sequential in a total precedence order, which gives exactly the outcome the
upstream optimistic-concurrency engine promises ("as if one pass in priority order") without its
nondeterminism. The phases live one module each; this one only sequences them and caches. See
docs/decision-engine.md for the rules and every deliberate deviation.
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice, repeat
from operator import attrgetter, is_, setitem, sub
from typing import Literal

from bigfleet.machine.inventory import Inventory
from bigfleet.machine.record import Machine, MachineShape
from bigfleet.machine.state import MachineState
from bigfleet.needs import Need, NeedsTable

from .acquire import acquisition_actions
from .baseline import Baseline
from .index import IDLE, SPEC, Index, apply_changes, build_index, free_supply
from .ledgers import CarriedShort, Ledgers, ShortPart, ledgers
from .normalise import FoldMemo, cluster_rows
from .order import acquire_all, credit_all, needs_by_cluster
from .preempt import preempt_all
from .reclaim import ReclaimWalk, reclaim_all
from .release import idle_releases
from .scratch import ClusterHeld, CycleScratch, NeedRow, RowMaker
from .types import Action, Decision, Drain, EngineConfig, EngineState, PhaseStats, Verdict
from .verdicts import rows_verdicts

_MACHINE_ID = attrgetter("id")
_ORDER = attrgetter("order")
_VERDICT_ORDER = attrgetter("fingerprint", "folded_into")
#: what `decide` accepts as the fleet: an `Inventory`, or any iterable of machine records
Fleet = Inventory | Iterable[Machine]
#: a cached cluster is valid for ((dimensions, classes version), its bound-set version, the free-pool
#: version when its Same folding depended on the free pool, else None)
CacheKey = tuple[tuple[tuple[str, ...], int], int, int | None]
#: (reclaim grace, cap fraction) → the first drains and how many machines were excess
ReclaimMemo = tuple[tuple[int, float], list[Drain], int]


@dataclass(frozen=True)
class UnmetWatch:
    """What a cached cluster with unmet needs also depends on: its unmet needs' eligible classes had
    no free supply, no DRAINING machine and no Configured machine stamped below the need's priority
    (nothing to acquire, await or preempt), and no machine was in flight for any of its needs. While
    that still holds (the classes' Configured sets unchanged, their pools and drains still empty,
    nothing Creating or reserved for its fingerprints), recomputing would give the same result."""

    classes: tuple[int, ...]
    configured_vers: tuple[int, ...]
    fingerprints: tuple[str, ...]


class ClusterCache:
    """A cluster whose result involves nothing global, so its Phase-1 result, verdicts and excess can
    be reused while its inputs are unchanged: every need met by its own bound machines, or (with a
    `watch`) the unmet ones provably unable to get anything anywhere."""

    __slots__ = ("aged", "credited", "domains", "drains", "folded", "gangs", "hconf", "held", "key", "needs", "plain",
                 "rows", "short", "unmet_rows", "verdicts", "walk", "watch")

    def __init__(self, key: CacheKey, needs: tuple[Need, ...], rows: list[NeedRow], held: ClusterHeld,
                 verdicts: list[Verdict], domains: dict[str, str], hconf: int, watch: UnmetWatch | None) -> None:
        self.key = key
        self.watch = watch
        #: rows short after Phase 1: their unmet age moves every cycle (the ledgers follow through
        #: `short`; the verdicts hold each streak's start, re-issued by `aged` only if it moves; the
        #: rows' own `unmet_age` stays as first computed)
        self.unmet_rows: list[NeedRow] = []
        credited = folded = 0
        no_gang = True
        for n in rows:  # (one plain loop: cheaper than a generator or C-level map per field)
            if any(n.p1_remaining):
                self.unmet_rows.append(n)
            credited += n.credited
            if n.same is not None:
                no_gang = False
            members = n.members
            if len(members) > 1 or members[0] is not n.need:
                folded += len(members)
        self.short = ShortPart(self.unmet_rows[0].cluster, self.unmet_rows) if self.unmet_rows else None
        self.aged = _AgedVerdicts(verdicts, self.short.keys) if self.short is not None else None
        self.needs = needs
        self.rows = rows
        self.held = held
        self.verdicts = verdicts
        self.drains: ReclaimMemo | None = None
        self.walk: ReclaimWalk | None = None
        self.domains = domains
        #: verdicts of folded needs (one per member of a folded row)
        self.folded = folded
        self.hconf = hconf
        self.credited = credited
        #: what `_still_stable` compares against the carried state (Same rows only; usually empty)
        self.gangs = () if no_gang else tuple((n.park_key, n.park_age, n.same_domain) for n in rows
                                              if n.same is not None)
        #: no Same need (whose folding depends on which classes the cluster holds), every need met. A
        #: Same need's row is a gang or folded, so the rows tell without a look at every profile.
        self.plain = watch is None and no_gang and not folded

    def keep_if_unheld_lost(self, ix: Index, cluster: str, cver: int) -> None:
        """Follow the cluster's new version when this sync only removed machines none of its needs
        held: crediting takes, per keep-ordered stream, a prefix of the machines still unheld, so
        one it never reached changes nothing. Only the reclaim drains (counts changed) are stale."""
        log = ix.bound_log.get(cluster)
        if not self.plain or log is None or log.added or log.before != self.key[1]:
            return
        # machines the reclaim walk had explored are unheld (its check is kept for `_resumed`);
        # else the held map tells
        walk = self.walk
        if not (walk is not None and walk.explored_all(log)) and not self.held.ids().keys().isdisjoint(log.removed):
            return
        self.key = (self.key[0], cver, self.key[2])
        self.drains = None


@dataclass
class _FreshCluster:
    """A cluster recomputed this cycle: its needs, the cache key its result would have, its rows."""

    cluster: str
    needs: tuple[Need, ...]
    key: CacheKey
    rows: list[NeedRow]


@dataclass
class _Split:
    """The clusters of one cycle: reused from the cache, or recomputed (with their folded count)."""

    cached: dict[str, ClusterCache]
    fresh: list[_FreshCluster]
    folded: int
    needs_in: int
    #: reused clusters that are still short (aged this cycle; the ledgers count them)
    short_parts: dict[str, ShortPart]


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
        self._src: Fleet | None = None
        self._gen: int | None = None
        self._base = Baseline({})
        self._since_full = 0
        #: every this many syncs the inventory is diffed in full instead of by its changed tail. Only a
        #: safety net (the tail sync is exact for `Inventory`, and a removal forces a full diff anyway),
        #: and a full diff is O(fleet): ~0.5-1 s at 500 000 machines, so every 16th cycle of a busy
        #: shard was slow enough to set its cycle p99 (scale runs: > 1 s).
        self.full_diff_every = 1024
        self._cache: dict[str, ClusterCache] = {}
        self._cdims: dict[str, tuple[tuple[Need, ...], frozenset[str]]] = {}
        #: class idx → (its configured version, the lowest priority stamped on its Configured machines)
        self._lowest_prio: dict[int, tuple[int, int]] = {}
        #: the reused short clusters' shortfall groups, updated by the clusters that joined or left
        self._short = CarriedShort()
        #: the unmet-age map the last (completed) cycle emitted: a state carrying that very map needs
        #: no age lookups for reused clusters (see `ShortPart.age`); None after a failed cycle
        self._emitted_unmet: Mapping[str, int] | None = None
        #: the cycle the last (completed) cycle's state carries (with `_emitted_unmet`: the carried
        #: ages moved in step with the cycle, so every reused verdict's `unmet_since` still holds)
        self._emitted_cycle = -1
        self.last_index_changes = 0
        #: how the last sync caught the index up: "" (nothing changed), "rebuild", "journal" (the
        #: inventory's write journal), "tail" (its changed tail, looked up by id) or "diff" (in full)
        self.last_sync = ""
        #: how many reused clusters had unmet needs last cycle (tests check the path is exercised)
        self.last_unmet_reused = 0

    # --- inventory → index -----------------------------------------------------------------------

    def _sync(self, inventory: Fleet) -> Index:
        if self._ix is not None:
            self._ix.bound_log.clear()  # (what `_split` reads is this sync's changes only)
        gen = getattr(inventory, "generation", None)
        if self._ix is not None and inventory is self._src and gen is not None and gen == self._gen:
            self.last_index_changes = 0
            self.last_sync = ""
            return self._ix
        machines_of = getattr(inventory, "machines", None)  # an Inventory, or a view shaped like one
        ms: Sequence[Machine] = machines_of() if callable(machines_of) else list(inventory)
        if self._ix is None:
            return self._rebuild(inventory, ms, gen)
        self._since_full += 1
        if isinstance(inventory, Inventory) and inventory is self._src and self._gen is not None:
            # Asked at every sync after the first, so the journal starts where this one ends; a
            # one-shot engine (`decide()`, what-if, a consolidation plan) never starts one.
            olds = inventory.replaced_since(self._gen)
            writes = inventory.generation - self._gen
            # (a journal entry per generation step: a writer that skipped the journal shows here)
            kind = ("" if self._since_full >= self.full_diff_every
                    else "journal" if olds is not None and len(olds) == writes and self._journal_sync(inventory, ms, olds)
                    else "tail" if self._tail_sync(ms, writes)
                    else "")
            if kind:
                self.last_sync = kind
                self._gen = gen
                return self._ix
        self._since_full = 0
        self.last_sync = "diff"  # (or "rebuild", when the diff finds most of the fleet changed)
        return self._full_diff(inventory, ms, gen)

    def _journal_sync(self, inventory: Inventory, ms: Sequence[Machine], olds: list[Machine | None]) -> bool:
        """O(changes) sync from `Inventory.replaced_since`: the written records are the last
        ``len(olds)`` of `ms`, in the journal's order, so no id is looked up (the tail sync's lookups
        in the baseline table were ~15 % of a 25 000-drain wave), and the baseline files them only
        when read (`Baseline`). False when the counts do not add up."""
        k = len(olds)
        replaced = [old for old in olds if old is not None]
        adds = k - len(replaced)
        if k > len(ms) or len(ms) != len(self._base) + adds:
            return False
        added = list(islice(reversed(ms), k))
        added.reverse()
        ix = self._ix
        assert ix is not None
        apply_changes(ix, replaced, added)
        self._base.written(added, adds, inventory.id_table)
        self.last_index_changes = k + len(replaced)
        return True

    def _full_diff(self, inventory: Fleet, ms: Sequence[Machine], gen: int | None) -> Index:
        """Apply what changed by record identity; a large change is a rebuild."""
        by_mid = self._base.table()
        now_ids = set(map(id, ms))
        prev = list(by_mid.values())
        gone = [m for m in prev if id(m) not in now_ids]
        prev_ids = set(map(id, prev))
        added_objs = [m for m in ms if id(m) not in prev_ids]
        if len(gone) + len(added_objs) > max(1000, len(now_ids) // 4):
            return self._rebuild(inventory, ms, gen)
        ix = self._ix
        assert ix is not None
        apply_changes(ix, gone, added_objs)
        for old in gone:
            if by_mid.get(old.id) is old:
                del by_mid[old.id]
        for m in added_objs:
            by_mid[m.id] = m
        self._src, self._gen = inventory, gen
        self.last_index_changes = len(gone) + len(added_objs)
        return ix

    def _tail_sync(self, ms: Sequence[Machine], writes: int) -> bool:
        """O(changes) sync for `bigfleet.machine.Inventory`, whose every write re-inserts the record at
        the end of its (insertion-ordered) table: new records are exactly the tail that is not in the
        baseline. Returns False (caller does a full diff) when the counts do not add up, e.g. after a
        removal; a periodic full diff (`full_diff_every`) guards against anything else. `writes`: how
        far the inventory's generation moved, at least the tail's length (only sizes the search)."""
        by_mid = self._base.table()
        added, ids, olds = _new_tail(ms, by_mid, writes)
        replaced = [old for old in olds if old is not None]
        if len(ms) != len(by_mid) - len(replaced) + len(added) or len(set(ids)) != len(ids):
            return False
        ix = self._ix
        assert ix is not None
        added.reverse()
        ids.reverse()
        apply_changes(ix, replaced, added)
        by_mid.update(zip(ids, added, strict=True))
        self.last_index_changes = len(added) + len(replaced)
        return True

    def _rebuild(self, inventory: Fleet, ms: Sequence[Machine], gen: int | None) -> Index:
        self.last_sync = "rebuild"
        if isinstance(inventory, Inventory):
            by_shape = [(st, shape, group) for st in MachineState for shape, group in inventory.by_state(st).by_shape()]
            ix = build_index(ms, by_shape)
            by_mid = inventory.id_table()
        else:
            ix = build_index(ms)
            by_mid = dict(zip(map(_MACHINE_ID, ms), ms, strict=True))
        self._base = Baseline(by_mid)
        self._since_full = 0
        self._ix = ix
        self._src, self._gen = inventory, gen
        self._cache.clear()
        self._lowest_prio.clear()
        self.last_index_changes = len(by_mid)
        return ix

    def free_supply(self, busy: Iterable[str] = ()) -> dict[MachineShape, tuple[int, int]]:
        """(idle, speculative) free machines per shape as of the last `decide` (cluster-less, not in
        `busy`): O(classes + busy), for availability hints without a walk over the fleet."""
        if self._ix is None:
            return {}
        src = self._src
        if isinstance(src, Inventory) and src.generation == self._gen:  # (its table is the baseline)
            return free_supply(self._ix, busy, src.id_map())
        return free_supply(self._ix, busy, self._base.table())

    # --- the cycle -------------------------------------------------------------------------------

    def decide(self, needs: Sequence[Need] | NeedsTable, inventory: Fleet, now_unix_nanos: int,
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
            return self._decide(ix, needs_by_cluster(needs), now_unix_nanos, state, config, reservations or {})
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
        cy = CycleScratch(ix, self._dims(by_cluster), reservations, state.cycle + 1)
        emitted = state.unmet_ages is self._emitted_unmet
        in_step = emitted and state.cycle == self._emitted_cycle
        prev_unmet, self._emitted_unmet = self._emitted_unmet, None
        split = self._split(cy, by_cluster, state, config, emitted, in_step)
        work = [n for fc in split.fresh for n in fc.rows]
        work.sort(key=_ORDER)
        self._mark("phase1_prepare")
        credit_all(cy, work, state, config.gangs_credit_first)
        # clusters fully served by their own bound machines are cacheable
        stable = _stable_clusters(split.fresh)
        self._mark("phase1_credit")
        acquire_all(cy, work)
        ages = state.unmet_ages
        for n in work:
            rem = n.p1_remaining = n.remaining
            if any(rem):
                n.unmet_age = ages.get(n.key, 0) + 1
        self._mark("phase1_acquire")
        counters = {"victims_scanned": 0}
        preempts, _ = preempt_all(cy, work, config, counters)
        self._mark("phase2")
        watches = {fc.cluster: w for fc in split.fresh
                   if fc.cluster not in stable and (w := self._unmet_watch(cy, fc)) is not None}
        verdicts, domains = self._verdicts(cy, by_cluster, split, stable, watches)
        self._mark("verdicts")
        reclaims, deferred = reclaim_all(cy, state, config, preempts, self._cache, by_cluster)
        releases = idle_releases(cy, now, config)
        self._mark("phase3")
        actions: list[Action] = acquisition_actions(work) + preempts + reclaims + releases
        truncated: list[Action] = []
        if config.max_actions_per_cycle > 0 and len(actions) > config.max_actions_per_cycle:
            truncated = actions[config.max_actions_per_cycle:]
            actions = actions[: config.max_actions_per_cycle]
        self._short.sync(split.short_parts, cy.dims)
        led = ledgers(cy, work, state, config, self._short, prev_unmet if emitted else None)
        next_state = EngineState(  # key-sorted so equal states also print (and serialise) identically
            cycle=state.cycle + 1,
            shortfall_ages=dict(sorted(led.shortfall_ages.items())),
            unmet_ages=led.unmet_ages,
            parking=dict(sorted(led.parking.items())),
            same_domains=dict(sorted(domains.items())),
            first_rollup=state.first_rollup,
        )
        stats = _stats(ix, split, work, led, len(preempts), counters["victims_scanned"], len(reclaims), deferred,
                       len(releases), len(truncated))
        self._emitted_unmet, self._emitted_cycle = next_state.unmet_ages, next_state.cycle
        self._mark("ledgers")
        self.last_phase_seconds.pop("_t", None)
        return _decision(actions, truncated, led, verdicts, stats, next_state, config)

    def _dims(self, by_cluster: dict[str, tuple[Need, ...]]) -> tuple[str, ...]:
        """The cycle's resource dimensions: the union over every need (cached per cluster)."""
        dim_set: set[str] = set()
        cdims = self._cdims
        for c, cn in by_cluster.items():
            got = cdims.get(c)
            if got is None or got[0] is not cn:
                # (a Resources' map holds exactly its non-zero names; one C-level union per cluster)
                names = frozenset().union(*map(_AGG_MAP, cn), *map(_MINU_MAP, cn))
                got = cdims[c] = (cn, names)
            dim_set |= got[1]
        for c in [c for c in cdims if c not in by_cluster]:
            del cdims[c]
        return tuple(sorted(dim_set))

    def _split(self, cy: CycleScratch, by_cluster: dict[str, tuple[Need, ...]], state: EngineState,
               config: EngineConfig, emitted: bool, in_step: bool) -> _Split:
        """Reuse every cluster whose cache entry still holds; normalise the others into rows.

        A cached cluster depends on the free pool only through Same folding (see `normalise.normalize_rows`):
        its key carries the free-pool version only then, so binds and releases elsewhere do not
        invalidate it.
        """
        ix = cy.ix
        base_key = (cy.dims, ix.classes_ver)
        free_ver = ix.free_ver
        split = _Split({}, [], 0, 0, {})
        free: set[int] | None = None
        watch_check = _WatchCheck(ix)
        maker = RowMaker(cy.dims)
        fold = FoldMemo()
        self.last_unmet_reused = 0
        for c in sorted(by_cluster):
            cn = by_cluster[c]
            split.needs_in += len(cn)
            cver = ix.cluster_ver.get(c, 0)
            cc = self._cache.get(c)
            if cc is not None and cc.key[1] != cver:
                cc.keep_if_unheld_lost(ix, c, cver)
            if (cc is not None and cc.key[0] == base_key and cc.key[1] == cver
                    and (cc.key[2] is None or cc.key[2] == free_ver)
                    and (cc.needs is cn or cc.needs == cn) and (not cc.gangs or _still_stable(cc, state))
                    and (cc.watch is None or watch_check.holds(cc.watch))):
                split.cached[c] = cc
                cy.held[c] = cc.held
                cy.hconf[c] = cc.hconf
                if cc.short is not None:
                    _age_unmet(cc, cc.short, state, emitted, in_step)
                    split.short_parts[c] = cc.short
                    self.last_unmet_reused += 1
                continue
            if free is None:
                free = {ci for (_st, ci) in ix.pool}
            rows, folded, free_dep = cluster_rows(maker, cn, ix, free, fold)
            split.folded += folded
            _age_parking(rows, state, config)
            split.fresh.append(_FreshCluster(c, cn, (base_key, cver, free_ver if free_dep else None), rows))
        for c in list(self._cache):
            if c not in split.cached:
                del self._cache[c]
        return split

    def _verdicts(self, cy: CycleScratch, by_cluster: dict[str, tuple[Need, ...]], split: _Split,
                  stable: set[str], watches: dict[str, UnmetWatch]) -> tuple[list[Verdict], dict[str, str]]:
        """Verdicts and gang domains, cluster by cluster in sorted order; stable clusters are cached."""
        verdicts: list[Verdict] = []
        domains: dict[str, str] = {}
        fresh_by_cluster = {fc.cluster: fc for fc in split.fresh}
        for c in sorted(by_cluster):
            cc = split.cached.get(c)
            if cc is not None:
                verdicts.extend(cc.verdicts)
                domains.update(cc.domains)
                continue
            fc = fresh_by_cluster[c]
            vs = rows_verdicts(cy, fc.rows)
            doms: dict[str, str] = {}
            for n in fc.rows:
                if n.same is not None and n.same_domain:
                    doms[n.park_key] = n.same_domain
            vs.sort(key=_VERDICT_ORDER)
            verdicts.extend(vs)
            domains.update(doms)
            if c in stable or c in watches:
                self._cache[c] = ClusterCache(fc.key, fc.needs, fc.rows, cy.held_in(c), vs, doms,
                                              cy.hconf.get(c, 0), watches.get(c))
        return verdicts, domains

    def _unmet_watch(self, cy: CycleScratch, fc: _FreshCluster) -> UnmetWatch | None:
        """The `UnmetWatch` of a cluster whose short needs could get nothing this cycle; None when its
        result involved anything global (an acquisition, a victim, a drain awaited, a reservation,
        a gang) or some short need had supply it could have competed for."""
        ix = cy.ix
        classes: set[int] = set()
        checked: set[tuple[int, int]] = set()  # (id of an eligible list, priority): rows mostly share both
        for n in fc.rows:
            if (n.same is not None or n.reserved_credit or n.acquired_idle or n.acquired_spec or n.victims
                    or n.remaining != n.p1_remaining):
                return None
            if not any(n.p1_remaining):
                continue
            eligible = cy.eligible(n)  # (cached in `cy` for the cycle, so its id is stable)
            if (id(eligible), n.prio) in checked:
                continue
            checked.add((id(eligible), n.prio))
            for c in eligible:
                ci = c.idx
                if ((IDLE, ci) in ix.pool or (SPEC, ci) in ix.pool or ix.draining_by_class.get(ci)
                        or self._lowest_configured_priority(ix, ci) < n.prio):
                    return None
                classes.add(ci)
        fingerprints = tuple(n.fp for n in fc.rows)
        if any(ix.creating.get(fp) or ix.reserved_idle.get(fp) for fp in fingerprints):
            return None
        ordered = tuple(sorted(classes))
        return UnmetWatch(ordered, tuple(ix.configured_ver.get(ci, 0) for ci in ordered), fingerprints)

    def _lowest_configured_priority(self, ix: Index, ci: int) -> int:
        """The lowest stamped priority among the class's Configured machines (cached per version)."""
        ver = ix.configured_ver.get(ci, 0)
        hit = self._lowest_prio.get(ci)
        if hit is not None and hit[0] == ver:
            return hit[1]
        lowest = min((m.assignment.priority for m in ix.configured_by_class.get(ci, ())), default=_NO_VICTIM)
        self._lowest_prio[ci] = (ver, lowest)
        return lowest


def _new_tail(ms: Sequence[Machine], by_mid: Mapping[str, Machine], writes: int = 0
              ) -> tuple[list[Machine], list[str], list[Machine | None]]:
    """The records at the end of `ms` that are not the baseline's (newest first), their ids and the
    baseline's records of those ids, found in growing chunks with C-level passes (a Python step per
    record cost ~1.5 µs: 40 ms a wave).

    The first chunk is `writes` + 1 (the tail is at most that long, one more shows its boundary), up
    to a cap: doubling from 16 read up to twice the tail, each read a lookup in the id table (~0.4 µs
    at 500 000 machines: ~15 ms of a 25 000-drain wave)."""
    tail = reversed(ms)
    added: list[Machine] = []
    ids: list[str] = []
    olds: list[Machine | None] = []
    size = max(16, min(writes + 1, _FIRST_CHUNK_CAP))
    while True:
        chunk: list[Machine] = list(islice(tail, size))
        cids = list(map(_MACHINE_ID, chunk))
        prev = list(map(by_mid.get, cids))
        known = list(map(is_, prev, chunk))
        stop = known.index(True) if True in known else len(chunk)
        added += chunk[:stop]
        ids += cids[:stop]
        olds += prev[:stop]
        if stop < size:
            return added, ids, olds
        size *= 2


#: the largest first chunk `_new_tail` reads on the generation's word (many writes to few records
#: must not cost a read of the whole inventory)
_FIRST_CHUNK_CAP = 1 << 16

#: above every priority: a class without Configured machines has no victim for anyone
_NO_VICTIM = 2**63


class _WatchCheck:
    """Checks `UnmetWatch`es against this cycle's index: the class part is shared by many clusters
    (memoised), the in-flight part is one set intersection per cluster."""

    def __init__(self, ix: Index) -> None:
        self.ix = ix
        self.classes_ok: dict[tuple[tuple[int, ...], tuple[int, ...]], bool] = {}
        self._in_flight: set[str] | None = None

    def holds(self, watch: UnmetWatch) -> bool:
        key = (watch.classes, watch.configured_vers)
        ok = self.classes_ok.get(key)
        if ok is None:
            ix = self.ix
            pool, draining, vers = ix.pool, ix.draining_by_class, ix.configured_ver
            ok = all(vers.get(ci, 0) == ver and (IDLE, ci) not in pool and (SPEC, ci) not in pool
                     and not draining.get(ci) for ci, ver in zip(watch.classes, watch.configured_vers, strict=True))
            self.classes_ok[key] = ok
        if not ok:
            return False
        if self._in_flight is None:  # fingerprints with a machine Creating or reserved Idle for them
            self._in_flight = {fp for by_fp in (self.ix.creating, self.ix.reserved_idle)
                               for fp, machines in by_fp.items() if machines}
        return self._in_flight.isdisjoint(watch.fingerprints)


def _age_unmet(cc: ClusterCache, short: ShortPart, state: EngineState, emitted: bool, in_step: bool) -> None:
    """Move a reused cluster's short rows to this cycle's unmet ages. Its verdicts hold where each
    unmet streak started, which moves only when the carried ages did not move in step with the
    cycle (a state this engine did not emit: a restore, a what-if, a cleared ledger)."""
    ages = short.age(state.unmet_ages, emitted)
    if not in_step:
        assert cc.aged is not None
        cc.verdicts = cc.aged.issue(cc.verdicts, list(map(sub, repeat(state.cycle + 1), ages)))


def _consume(it: Iterable[object]) -> None:
    """Run a C-level `map` for its effect."""
    deque(it, maxlen=0)


_new = object.__new__
_AGG_MAP = attrgetter("aggregate_resources._map")
_MINU_MAP = attrgetter("min_unit._map")
_DICT = attrgetter("__dict__")


class _AgedVerdicts:
    """Where a reused short cluster's unmet verdicts sit and which of its need keys each reports, so
    new streak starts re-issue them by C-level maps instead of a Python loop per verdict."""

    __slots__ = ("key_pos", "pos", "starts", "templates")

    def __init__(self, verdicts: list[Verdict], keys: list[str]) -> None:
        at = {k: i for i, k in enumerate(keys)}
        self.pos = [i for i, v in enumerate(verdicts) if not v.satisfied]
        unmet = [verdicts[i] for i in self.pos]
        key_pos = [at[v.cluster_id + "\x00" + (v.folded_into or v.fingerprint)] for v in unmet]
        #: None when the unmet verdicts are the keys one to one, in order (no folding: the usual case)
        self.key_pos = None if key_pos == list(range(len(keys))) else key_pos
        #: the verdicts' field dicts as first built (never mutated: each re-issue copies them)
        self.templates = [v.__dict__ for v in unmet]
        #: each unmet verdict's `unmet_since` as last issued
        self.starts = [v.unmet_since for v in unmet]

    def issue(self, verdicts: list[Verdict], key_starts: list[int]) -> list[Verdict]:
        """`verdicts` with each unmet one replaced by an equal record but for `unmet_since` (as
        `build_fast`: one C-level dict copy per record), or `verdicts` itself when no start moved."""
        starts = key_starts if self.key_pos is None else list(map(key_starts.__getitem__, self.key_pos))
        if starts == self.starts:
            return verdicts
        self.starts = starts
        fresh: list[Verdict] = list(map(_new, repeat(Verdict, len(self.templates))))
        fields = list(map(_DICT, fresh))
        _consume(map(dict.update, fields, self.templates))
        _consume(map(dict.__setitem__, fields, repeat("unmet_since"), starts))
        out = verdicts.copy()
        _consume(map(setitem, repeat(out), self.pos, fresh))
        return out


def _stable_clusters(fresh: list[_FreshCluster]) -> set[str]:
    """Clusters fully served by their own bound machines (cacheable); a loop, not a generator per cluster."""
    out: set[str] = set()
    for fc in fresh:
        for n in fc.rows:
            if n.reserved_credit or n.parked or any(n.remaining):
                break
        else:
            out.add(fc.cluster)
    return out


def _age_parking(rows: list[NeedRow], state: EngineState, config: EngineConfig) -> None:
    """A gang parks from `park_after_cycles` short cycles on, except on re-probe ages."""
    for n in rows:
        if n.same is not None:
            age = state.parking.get(n.park_key, 0)
            n.park_age = age
            n.parked = age >= config.park_after_cycles and (
                config.reprobe_every_cycles <= 0 or age % config.reprobe_every_cycles != 0)


def _stats(ix: Index, split: _Split, work: list[NeedRow], led: Ledgers, preempts: int, victims_scanned: int,
           reclaims: int, deferred: int, releases: int, truncated: int) -> PhaseStats:
    cached = split.cached.values()
    credited = bootstraps = provisions = parked = 0
    for n in work:  # (one loop: a generator per sum cost more than the sums)
        credited += n.credited
        bootstraps += len(n.acquired_idle)
        provisions += len(n.acquired_spec)
        if n.parked:
            parked += 1
    return PhaseStats(
        needs_in=split.needs_in,
        needs_normalized=len(work) + sum(len(cc.rows) for cc in cached),
        needs_folded=split.folded + sum(cc.folded for cc in cached),
        machines=ix.total,
        machine_classes=len(ix.classes),
        credited=credited + sum(cc.credited for cc in cached),
        bootstraps=bootstraps,
        provisions=provisions,
        unsatisfied=led.unsatisfied,
        parked=parked,
        preempts=preempts,
        unresolved=led.unresolved,
        victims_scanned=victims_scanned,
        reclaims=reclaims,
        reclaims_deferred=deferred,
        releases=releases,
        actions_truncated=truncated,
        clusters_recomputed=len(split.fresh),
        clusters_reused=len(split.cached),
    )


def _decision(actions: list[Action], truncated: list[Action], led: Ledgers, verdicts: list[Verdict],
              stats: PhaseStats, next_state: EngineState, config: EngineConfig) -> Decision:
    mode: Literal["normal", "paused", "dry_run"] = "normal"
    suppressed: tuple[Action, ...] = ()
    emitted = tuple(actions)
    if config.paused or config.dry_run:
        mode = "paused" if config.paused else "dry_run"
        suppressed, emitted = emitted, ()
    return Decision(
        actions=emitted,
        shortfalls=tuple(led.shortfalls),
        verdicts=tuple(verdicts),
        stats=stats,
        state=next_state,
        suppressed=suppressed,
        deferred=tuple(truncated),
        mode=mode,
    )


def _still_stable(cc: ClusterCache, state: EngineState) -> bool:
    """A cached cluster stays valid only if the carried state agrees with what it was built from."""
    parking, domains = state.parking, state.same_domains
    for park_key, age, domain in cc.gangs:
        if parking.get(park_key, 0) != age or domains.get(park_key) != domain:
            return False
    return True


def decide(needs: Sequence[Need] | NeedsTable, inventory: Fleet, now_unix_nanos: int, state: EngineState,
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
    return eng._decide(ix, needs_by_cluster(needs), now_unix_nanos, state, config, reservations or {})
