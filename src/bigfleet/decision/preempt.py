"""Phase 2, preempt: needs still short take strictly lower-priority Configured machines.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Iterable

from bigfleet.machine.record import Assignment, Machine

from .index import (
    MClass,
    VictimItem,
    VictimKey,
    m_interruption,
    m_reclamation,
    victim_stream,
)
from .scratch import CycleScratch, NeedRow
from .types import (
    DRAIN_GRACE_DEFAULT_SECONDS,
    DRAIN_GRACE_TIERS,
    Action,
    Drain,
    EngineConfig,
    drain_grace_seconds,
    victim_score,
)
from .vec import vadd, vsub

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


def _await_draining(cy: CycleScratch, n: NeedRow, classes: list[MClass]) -> bool:
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
            n.remaining = vsub(n.remaining, a)
            if not any(n.remaining):
                return True
    return False


class _Preemption:
    """What Phase 2 has decided so far this cycle: the drains, in order, and the victims' ids."""

    __slots__ = ("actions", "cy", "scanned", "victims")

    def __init__(self, cy: CycleScratch) -> None:
        self.cy = cy
        self.actions: list[Action] = []
        self.victims: set[str] = set()
        self.scanned = 0

    def take(self, n: NeedRow, m: Machine, victim_prio: int) -> None:
        self.victims.add(m.id)
        a = self.cy.alloc[self.cy.ix.class_of_shape[m.shape]]
        n.victims += 1
        n.freed = vadd(n.freed, a)
        n.remaining = vsub(n.remaining, a)
        self.actions.append(Drain(m.id, m.cluster, drain_grace_seconds(n.prio, victim_prio), n.prio, "preempt"))


def preempt_all(cy: CycleScratch, rows: list[NeedRow], config: EngineConfig, stats: dict[str, int]
                ) -> tuple[list[Action], set[str]]:
    """Victims for every need still short after Phase 1 (precedence order); the drains and victims."""
    done = _Preemption(cy)
    for n in rows:
        if not any(n.remaining) or n.parked or n.unmet_age < config.preempt_after_cycles:
            continue
        if n.same is not None and not n.same_domain:
            continue
        if n.same is not None:
            classes = next((cl for v, cl in cy.domains(n, n.same.key) if v == n.same_domain), [])
        else:
            classes = cy.eligible(n)
        _preempt_for(cy, n, classes, done)
    stats["victims_scanned"] += done.scanned
    return done.actions, done.victims


def _victim_key_of(bounds: tuple[int, ...], price: float) -> VictimKey:
    """A candidate assignment's (score, stamped priority) in a class of this price: `_victim_key` with
    the grace of the stamped priority's tier; None for a stamp not strictly below the preemptor."""
    top = bounds[-1]

    def key(a: Assignment) -> tuple[float, int] | None:
        q = a.priority
        if q >= top:
            return None
        ipd, rpd = a.interruption_penalty_dollars, a.reclamation_penalty_dollars
        return (victim_score(0.0 if ipd != ipd or ipd < 0 else ipd, 0.0 if rpd != rpd or rpd < 0 else rpd,
                             _TIER_GRACE[bisect_right(bounds, q)], price), q)
    return key


def _preempt_for(cy: CycleScratch, n: NeedRow, classes: list[MClass], done: _Preemption) -> None:
    """Take the lowest-scored strictly lower-priority victims among `classes` until `n` is covered.

    The candidate streams are in stamped-tier key order. A machine credited this cycle to a need of
    its cluster with a higher priority than its stamp (still below this one) drains with that
    priority's grace, which may be longer: its true key is larger, so it waits in `later` until
    the stream has passed that key (every later machine's true key is at least its stream key).
    Keys are unique: they end in the machine id.
    """
    if _await_draining(cy, n, classes):
        return
    ix = cy.ix
    prio = n.prio
    bounds = _grace_bounds(prio)
    streams = [vs for c in classes if c.idx in ix.configured_by_class
               for vs in (victim_stream(ix, c.idx, bounds, _victim_key_of(bounds, c.shape.price_per_hour)),)
               if vs is not None]
    if not streams:
        return
    held, victims = cy.held, done.victims
    later: list[tuple[_VKey, Machine, int]] = []
    stream: Iterable[VictimItem] = streams[0] if len(streams) == 1 else heapq.merge(*streams)
    for score, q, mid, m in stream:  # q < prio: the streams hold only strictly lower stamps
        if not any(n.remaining):
            break
        done.scanned += 1
        if mid in victims:
            continue
        vprio = q
        h = held.get(m.cluster)
        holder = h.ids().get(mid) if h is not None else None
        if holder is not None:
            if holder is n or holder.prio >= prio:
                continue
            vprio = max(q, holder.prio)
        if math.isinf(m_interruption(m)):
            continue
        if later:
            k = (score, q, mid)
            while later and later[0][0] <= k and any(n.remaining):
                _, lm, lv = heapq.heappop(later)
                done.take(n, lm, lv)
            if not any(n.remaining):
                break
        if vprio != q and drain_grace_seconds(prio, vprio) != drain_grace_seconds(prio, q):
            heapq.heappush(later, (_victim_key(m, drain_grace_seconds(prio, vprio)), m, vprio))
            continue
        done.take(n, m, vprio)
    while later and any(n.remaining):
        _, lm, lv = heapq.heappop(later)
        done.take(n, lm, lv)
