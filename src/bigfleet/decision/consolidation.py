"""Consolidation: a pure phase after Phase 3 that spends less for the same demand.

Phase 1 credits a need's bound machines first whatever they cost, so without this a fleet never
moves off expensive capacity and a half-empty machine stays half-empty. Two steps, per cluster with
consolidation on (``EngineConfig.consolidation`` / ``consolidation_overrides``) and past its first
roll-up, for needs satisfied this cycle:

* **Acquire** a replacement (create-before-drain): a free Idle or Speculative machine that serves
  what one bound machine serves (``cheaper``), or what several of the need's bound machines serve
  together (``repack``, resource-vector needs with ``min_unit``), at an effective cost lower by more
  than ``consolidation_margin`` and repaying the price of moving (the reclamation penalty plus the
  old machines' drain grace) within ``consolidation_payback_hours``. Only a Configure/Create is
  emitted; nothing is drained yet.
* **Retire**: once the replacement is CONFIGURED the need is over-covered. For each such need the
  cheapest set of its bound machines that still covers it is kept and the rest drained with reason
  ``consolidate`` (in place of Phase 3's reclaim choice, which keeps machines by price alone and
  would retire a repack's one big machine instead of the several small ones). A need with a machine
  still on its way (Creating, reserved Idle, Configuring) is never retired from: the replacement is
  CONFIGURED before the old machine's ReclaimInstruction. One move per need at a time: a need with a
  machine Configuring or Draining gets no new replacement.

Never touched: pinned machines (infinite penalties), needs with a strict spread, machines any other
phase acted on; a need with a machine being drained this cycle (by any phase) gets no replacement. Retirements stay inside ``consolidation_max_moves`` per cluster and the cluster's
disruption budget room (``consolidation_room``, from the shard); all of a need's retirements fit, or
none are made (and then nothing of that need is drained this cycle). A cluster's retirements are
checked by re-deciding it on its remaining machines: if any of its needs would then be unmet, the
cluster keeps Phase 3's drains. Every move lowers $/h by more than the margin, so moves cannot cycle.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from bigfleet.machine.record import Machine
from bigfleet.needs import Need, NeedsTable, Operator
from bigfleet.needs.penalty import bucket_dollars

from .index import CONFIGURED, CONFIGURING, IDLE, SPEC, Index, MClass, m_interruption, m_reclamation
from .types import (
    REASON_CONSOLIDATE,
    Action,
    Configure,
    Create,
    Decision,
    Drain,
    EngineConfig,
    EngineState,
)

Vec = dict[str, int]


@dataclass(frozen=True)
class Move:
    """One planned replacement: ``new`` (Idle/Speculative) for ``old`` (bound machines of one need)."""

    cluster_id: str
    need_fingerprint: str
    kind: str  # "cheaper" | "repack"
    new: str
    old: tuple[str, ...]
    saving_per_hour: float


def enabled_clusters(config: EngineConfig, clusters: Iterable[str]) -> set[str]:
    """Clusters consolidation runs for: the shard's switch, overridden per cluster."""
    over = dict(config.consolidation_overrides)
    return {c for c in clusters if over.get(c, config.consolidation)}


def after_decide(engine: object, d: Decision, needs: Sequence[Need] | NeedsTable, state: EngineState,
                 config: EngineConfig) -> Decision:
    """The cycle runners' hook (shard/engines.py inline, shard/engineproc.py worker): consolidation on
    the index the engine just decided on. A no-op unless consolidation is on for some cluster."""
    if not config.consolidation and not any(on for _, on in config.consolidation_overrides):
        return d
    ix = getattr(engine, "_ix", None)
    if not isinstance(ix, Index):
        return d
    by_cluster: dict[str, Sequence[Need]]
    if isinstance(needs, NeedsTable):
        by_cluster = {c: needs.cluster(c) for c in needs.clusters()}
    else:
        lists: dict[str, list[Need]] = {}
        for n in needs:
            lists.setdefault(n.cluster_id, []).append(n)
        by_cluster = dict(lists)
    return consolidate(d, ix, by_cluster, state, config)


def consolidate(d: Decision, ix: Index, by_cluster: Mapping[str, Sequence[Need]], state: EngineState,
                config: EngineConfig) -> Decision:
    """The decision with consolidation's acquisitions and retirements folded in (see the module)."""
    plan = plan_moves(d, ix, by_cluster, state, config)
    if not plan.actions and not plan.drop_drains:
        return d
    actions = [a for a in (*d.actions, *d.suppressed) if a.machine_id not in plan.drop_drains]
    actions += plan.actions
    stats = replace(d.stats, consolidation_replacements=sum(isinstance(a, Configure | Create) for a in plan.actions),
                    consolidation_drains=sum(isinstance(a, Drain) for a in plan.actions),
                    consolidation_savings_per_hour=round(plan.saving, 6))
    if d.mode == "normal":
        return replace(d, actions=tuple(actions), stats=stats)
    return replace(d, suppressed=tuple(actions), stats=stats)


@dataclass
class Plan:
    """Consolidation's share of a cycle: actions to add, Phase 3 drains to withdraw, and why."""

    actions: list[Action]
    drop_drains: set[str]
    #: replacements acquired this cycle
    moves: list[Move]
    #: machines retired this cycle (their replacement is CONFIGURED)
    retired: list[Move]
    saving: float


def plan_moves(d: Decision, ix: Index, by_cluster: Mapping[str, Sequence[Need]], state: EngineState,
               config: EngineConfig) -> Plan:
    """What consolidation would do this cycle (``bigfleetctl consolidation --plan`` shows it)."""
    plan = Plan([], set(), [], [], 0.0)
    on = enabled_clusters(config, by_cluster) & set(state.first_rollup)
    if not on:
        return plan
    room = dict(config.consolidation_room)
    if d.stats.actions_truncated:
        return plan  # a follow-up cycle comes at once; consolidation waits for a whole one
    busy = {a.machine_id for a in (*d.actions, *d.suppressed, *d.deferred)}
    phase3 = {a.machine_id: a for a in (*d.actions, *d.suppressed) if isinstance(a, Drain) and a.reason == "reclaim"}
    satisfied = {(v.cluster_id, v.fingerprint) for v in d.verdicts if v.satisfied and not v.folded_into}
    taken: set[str] = set()
    for c in sorted(on):
        allowance = min(config.consolidation_max_moves, room.get(c, config.consolidation_max_moves))
        _cluster(plan, ix, c, by_cluster[c], satisfied, busy, phase3, taken, max(0, allowance), config)
    return plan


def _cluster(plan: Plan, ix: Index, c: str, needs: Sequence[Need], satisfied: set[tuple[str, str]], busy: set[str],
             phase3: Mapping[str, Drain], taken: set[str], allowance: int, config: EngineConfig) -> None:
    bound = ix.bound.get(c, {})
    conf: dict[str, list[Machine]] = {}
    for lst in bound.get(CONFIGURED, {}).values():
        for m in lst:
            conf.setdefault(m.assignment.need_fingerprint, []).append(m)
    # A need with a machine on its way in (Configuring) or out (Draining) is mid-move: one at a time.
    pending = {m.assignment.need_fingerprint for lst in bound.get(CONFIGURING, {}).values() for m in lst}
    pending |= {m.assignment.need_fingerprint for lst in ix.draining_by_class.values() for m in lst if m.cluster == c}
    retire: list[tuple[Need, list[Machine], float]] = []  # (need, machines to drain, $/h saved)
    drop: set[str] = set()
    for n in needs:
        fp = n.fingerprint
        if (c, fp) not in satisfied or fp in pending or ix.creating.get(fp) or ix.reserved_idle.get(fp):
            continue
        if n.profile.spread or math.isinf(bucket_dollars(n.interruption_bucket)) \
                or math.isinf(bucket_dollars(n.reclamation_bucket)):
            continue
        mine = [m for m in conf.get(fp, ()) if m.id not in busy or m.id in phase3]
        if not mine:
            continue
        keep, gone = _keep_set(ix, n, mine)
        p3 = {m.id for m in mine if m.id in phase3}
        if not gone or {m.id for m in gone} == p3 or not all(_movable(m) for m in gone):
            continue
        eff = _eff_fn(ix, n)
        was = sum(eff(m) for m in mine if m.id not in p3)  # what Phase 3 alone would keep
        now = sum(eff(m) for m in keep)
        if was - now <= config.consolidation_margin * was:
            continue
        drop |= p3  # Phase 3's choice goes either way: all of ours fit, or nothing of this need drains
        if len(gone) <= allowance:
            allowance -= len(gone)
            retire.append((n, gone, was - now))
    if (retire or drop) and _still_met(ix, c, needs, {m.id for _, gone, _ in retire for m in gone}, config):
        plan.drop_drains |= drop
        for n, gone, saved in retire:
            for m in sorted(gone, key=lambda m: m.id):
                plan.actions.append(Drain(m.id, c, config.reclaim_grace_seconds, 0, "consolidate"))
                busy.add(m.id)
            plan.retired.append(Move(c, n.fingerprint, "retire", "", tuple(sorted(m.id for m in gone)), saved))
            plan.saving += saved
    # Acquire: at most one replacement per need per cycle, while allowance remains.
    for n in needs:
        if allowance <= 0:
            break
        fp = n.fingerprint
        if (c, fp) not in satisfied or fp in pending or ix.creating.get(fp) or ix.reserved_idle.get(fp):
            continue
        if n.profile.spread or math.isinf(bucket_dollars(n.interruption_bucket)) \
                or math.isinf(bucket_dollars(n.reclamation_bucket)):
            continue
        if any(m.id in phase3 or m.id in plan.drop_drains or m.id in busy for m in conf.get(fp, ())):
            continue  # over-covered now: retire first, replace later
        mine = [m for m in conf.get(fp, ()) if _movable(m)]
        if not mine:
            continue
        mv = _best_move(ix, n, mine, taken, config)
        if mv is None or len(mv[1]) > allowance:
            continue
        new, old, saving, kind, state = mv
        allowance -= len(old)
        taken.add(new.id)
        busy.add(new.id)
        plan.actions.append(_acquire(n, new, state))
        plan.moves.append(Move(c, fp, kind, new.id, tuple(sorted(m.id for m in old)), saving))
        plan.saving += saving


def _movable(m: Machine) -> bool:
    return not (math.isinf(m_reclamation(m)) or math.isinf(m_interruption(m)))


def _eff_fn(ix: Index, n: Need) -> Callable[[Machine], float]:
    pen = bucket_dollars(n.interruption_bucket)

    def eff(m: Machine) -> float:
        return ix.cls(m).eff_cost(pen)
    return eff


def _dims(n: Need) -> tuple[str, ...]:
    return n.aggregate_resources.names()


def _alloc(c: MClass, dims: tuple[str, ...]) -> Vec:
    return {d: c.alloc.get(d) for d in dims}


def _covers(have: Vec, want: Mapping[str, int]) -> bool:
    return all(have.get(k, 0) >= v for k, v in want.items())


def _sum(vs: Iterable[Vec], dims: tuple[str, ...]) -> Vec:
    out = dict.fromkeys(dims, 0)
    for v in vs:
        for k in dims:
            out[k] += v.get(k, 0)
    return out


#: a need with at most this many bound machines gets the exact cheapest keep set (2^n subsets)
EXACT_KEEP_SET = 10


def _keep_set(ix: Index, n: Need, ms: list[Machine]) -> tuple[list[Machine], list[Machine]]:
    """The cheapest subset of ``ms`` that still covers the need (exact for a few machines, else the
    best of three greedy drop orders), and the rest. Ties keep more machines (fewer drains)."""
    dims = _dims(n)
    want = n.aggregate_resources.to_milli()
    eff = _eff_fn(ix, n)
    allocs = {m.id: _alloc(ix.cls(m), dims) for m in ms}
    total = _sum(allocs.values(), dims)
    if len(ms) < 2 or not any(_covers({k: total[k] - allocs[m.id].get(k, 0) for k in dims}, want) for m in ms):
        return list(ms), []  # tightly covered (the steady case): nothing can go
    best: tuple[float, int, list[Machine]] | None = None

    def consider(keep: list[Machine]) -> None:
        nonlocal best
        cost = sum(eff(m) for m in keep)
        if best is None or cost < best[0] - 1e-9 or (abs(cost - best[0]) <= 1e-9 and len(keep) > best[1]):
            best = (cost, len(keep), keep)

    if len(ms) <= EXACT_KEEP_SET:
        ordered = sorted(ms, key=lambda m: m.id)
        for mask in range(1, 1 << len(ordered)):
            keep = [m for i, m in enumerate(ordered) if mask >> i & 1]
            if _covers(_sum((allocs[m.id] for m in keep), dims), want):
                consider(keep)
    else:
        def per(m: Machine, capped: bool) -> float:
            a = allocs[m.id]
            got = sum((min(a.get(k, 0), want[k]) if capped else a.get(k, 0)) / want[k] for k in dims if want.get(k))
            return eff(m) / (got or 1e-9)

        orders = (sorted(ms, key=lambda m: (-eff(m), m.id)), sorted(ms, key=lambda m: (-per(m, True), m.id)),
                  sorted(ms, key=lambda m: (-per(m, False), m.id)))
        for order in orders:
            keep = list(ms)
            for m in order:
                rest = [k for k in keep if k is not m]
                if _covers(_sum((allocs[k.id] for k in rest), dims), want):
                    keep = rest
            consider(keep)
    if best is None:
        return list(ms), []
    kept = {m.id for m in best[2]}
    return best[2], [m for m in ms if m.id not in kept]


def _best_move(ix: Index, n: Need, mine: list[Machine], taken: set[str], config: EngineConfig
               ) -> tuple[Machine, list[Machine], float, str, int] | None:
    """The best single replacement for this need: (new machine, old machines, saving $/h, kind, state).

    For each class the need accepts, the dearest of its machines are swapped out while the rest plus
    one machine of the class still cover the need: one out is ``cheaper`` (or right-sized), several
    out is ``repack``."""
    dims = _dims(n)
    want = n.aggregate_resources.to_milli()
    unit = n.min_unit.to_milli()
    pen = bucket_dollars(n.interruption_bucket)
    same = [r.key for r in n.requirements if r.operator is Operator.SAME]
    eff = _eff_fn(ix, n)
    by_cost = sorted(mine, key=lambda m: (-eff(m), m.id))
    allocs = {m.id: _alloc(ix.cls(m), dims) for m in mine}
    grace_h = config.reclaim_grace_seconds / 3600.0
    recl = bucket_dollars(n.reclamation_bucket)
    best: tuple[Machine, list[Machine], float, str, int] | None = None
    ceiling = sum(eff(m) for m in mine) * (1.0 - config.consolidation_margin)
    for c in ix.matched_classes(n.requirements):
        if not ix.free_count.get(c.idx) or c.eff_cost(pen) >= ceiling:
            continue  # no free machine of the class, or it could not save enough even replacing them all
        if not _covers(_alloc(c, tuple(unit)), unit):
            continue
        if same and any(ix.cls(m).attrs.get(k) != c.attrs.get(k) for m in mine for k in same):
            continue  # a gang stays in its domain
        cost = c.eff_cost(pen)
        cap = _alloc(c, dims)
        old: list[Machine] = []
        rest = list(mine)
        for m in by_cost:
            left = [x for x in rest if x is not m]
            if _covers(_sum([cap, *(allocs[x.id] for x in left)], dims), want):
                old.append(m)
                rest = left
        if not old:
            continue
        was = sum(eff(m) for m in old)
        saving = was - cost
        price = sum(max(recl, m_reclamation(m)) for m in old) + was * grace_h
        if saving <= config.consolidation_margin * was or saving * config.consolidation_payback_hours <= price:
            continue
        if best is not None and saving <= best[2] + 1e-9:
            continue
        new = _free(ix, c, taken)
        if new is None:
            continue
        best = (new[0], old, saving, "cheaper" if len(old) == 1 else "repack", new[1])
    return best


def _free(ix: Index, c: MClass, taken: set[str]) -> tuple[Machine, int] | None:
    """A free machine of the class: Idle first (no create wait), unreserved, not already taken."""
    for st in (IDLE, SPEC):
        for m in ix.pool.get((st, c.idx), ()):
            if m.id in taken or m.cluster or m.assignment.need_fingerprint:
                continue
            return m, st
    return None


def _acquire(n: Need, m: Machine, state: int) -> Action:
    ipd, rpd = bucket_dollars(n.interruption_bucket), bucket_dollars(n.reclamation_bucket)
    if state == IDLE:
        return Configure(m.id, n.cluster_id, n.fingerprint, n.priority, ipd, rpd, n.requirements, n.group,
                         REASON_CONSOLIDATE)
    return Create(m.id, n.cluster_id, n.fingerprint, n.priority, ipd, rpd, n.requirements, n.group,
                  REASON_CONSOLIDATE)


def _still_met(ix: Index, c: str, needs: Sequence[Need], gone: set[str], config: EngineConfig) -> bool:
    """Re-decide the cluster alone on its bound machines minus ``gone``: every need it meets now
    must still be met by credit alone (catches a machine stamped for one need but credited to another)."""
    from .engine import decide

    machines = [m for st in (CONFIGURED, CONFIGURING) for lst in ix.bound.get(c, {}).get(st, {}).values()
                for m in lst if m.id not in gone]
    plain = replace(config, consolidation=False, consolidation_overrides=(), dry_run=True)
    before = decide(list(needs), [m for st in (CONFIGURED, CONFIGURING)
                                  for lst in ix.bound.get(c, {}).get(st, {}).values() for m in lst],
                    0, EngineState(), plain)
    after = decide(list(needs), machines, 0, EngineState(), plain)
    met = {(v.cluster_id, v.fingerprint) for v in before.verdicts if v.satisfied}
    return all(v.satisfied for v in after.verdicts if (v.cluster_id, v.fingerprint) in met)


def plan_on_copy(needs: Sequence[Need], machines: Sequence[Machine], now_unix_nanos: int, state: EngineState,
                 config: EngineConfig, cluster_id: str = "") -> tuple[Plan, set[str]]:
    """``bigfleetctl consolidation --plan``: the cycle decided on a copy of the shard's inputs, and
    consolidation's plan as if it were on (for ``cluster_id``, or every cluster), plus the clusters it
    is actually on for. Nothing is emitted; the caller's inputs are only read."""
    from .engine import Engine

    clusters = {n.cluster_id for n in needs}
    enabled = enabled_clusters(config, clusters)
    want = {cluster_id} if cluster_id else clusters
    cfg = replace(config, dry_run=True, paused=False, max_actions_per_cycle=0, consolidation=False,
                  consolidation_overrides=tuple((c, True) for c in sorted(want)))
    eng = Engine()
    d = eng.decide(needs, machines, now_unix_nanos, state, cfg)
    ix = getattr(eng, "_ix", None)
    if not isinstance(ix, Index):
        return Plan([], set(), [], [], 0.0), enabled
    by_cluster: dict[str, list[Need]] = {}
    for n in needs:
        if n.cluster_id in want:
            by_cluster.setdefault(n.cluster_id, []).append(n)
    return plan_moves(d, ix, by_cluster, state, cfg), enabled
