"""The carried ledgers after a cycle: unmet ages, gang parking, shortfalls (summed per profile)."""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from .scratch import CycleScratch, NeedRow
from .types import EngineConfig, EngineState, Shortfall
from .vec import to_resources
from .verdicts import unmet_reason


@dataclass(frozen=True)
class Ledgers:
    """What the cycle's recomputed needs leave for the next cycle and the report."""

    unmet_ages: dict[str, int]
    parking: dict[str, int]
    shortfall_ages: dict[str, int]
    shortfalls: list[Shortfall]
    unsatisfied: int
    unresolved: int


def ledgers(cy: CycleScratch, rows: Iterable[NeedRow], state: EngineState, config: EngineConfig,
            still_short: Sequence[NeedRow] = ()) -> Ledgers:
    """Unmet ages and parking from the Phase-1 deficit; shortfalls from what Phase 2 left short.

    `still_short`: rows of reused clusters, each short by the same amount after Phase 1 and Phase 2
    and no gang (the `UnmetWatch` conditions), so they skip the per-row tests. Rows may come in any
    order: a profile's shortfall takes its fields from its first row in precedence order, and only
    the reported head of the shortfall list is built.
    """
    unmet: dict[str, int] = {}
    parking: dict[str, int] = {}
    short: dict[str, list[NeedRow]] = {}
    n_unsat = n_unresolved = 0
    for n in rows:
        if not any(n.p1_remaining):
            continue
        if n.same is not None and not (n.acquired_idle or n.acquired_spec or n.same_sat):
            parking[n.park_key] = n.park_age + 1
        n_unsat += 1
        unmet[n.key] = n.unmet_age
        if n.remaining is n.p1_remaining or any(n.remaining):
            got = short.get(n.fp)
            if got is None:
                short[n.fp] = [n]
            else:
                got.append(n)
            n_unresolved += 1
    unmet.update([(n.key, n.unmet_age) for n in still_short])
    n_unsat += len(still_short)
    n_unresolved += len(still_short)
    get = short.get
    for n in still_short:
        got = get(n.fp)
        if got is None:
            short[n.fp] = [n]
        else:
            got.append(n)
    old_ages = state.shortfall_ages
    ages = {fp: old_ages.get(fp, 0) + 1 for fp in short}
    heads = {fp: (ns[0] if len(ns) == 1 else min(ns, key=_PRECEDENCE)) for fp, ns in short.items()}
    cap = max(0, config.shortfall_report_cap)
    reported = heapq.nsmallest(cap, short, key=lambda fp: (-heads[fp].prio, -ages[fp], fp))
    shortfalls = [_shortfall(cy, fp, short[fp], heads[fp], ages[fp], config) for fp in reported]
    return Ledgers(unmet, parking, ages, shortfalls, n_unsat, n_unresolved)


_PRECEDENCE = attrgetter("order")


def _shortfall(cy: CycleScratch, fp: str, rows: list[NeedRow], head: NeedRow, age: int,
               config: EngineConfig) -> Shortfall:
    deficit = tuple(map(sum, zip(*[n.remaining for n in rows], strict=True))) if rows else cy.zero
    return Shortfall(
        fingerprint=fp,
        requirements=head.reqs,
        deficit=to_resources(cy.dims, deficit),
        priority=head.prio,
        age_cycles=age,
        interruption_bucket=head.ib,
        reason=unmet_reason(cy, head, True),
        clusters=tuple(sorted({n.cluster for n in rows})),
        escalated=age > config.escalation_after_cycles,
    )
