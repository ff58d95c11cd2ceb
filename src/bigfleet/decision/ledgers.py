"""The carried ledgers after a cycle: unmet ages, gang parking, shortfalls (summed per profile)."""

from __future__ import annotations

from dataclasses import dataclass

from .scratch import CycleScratch, NeedRow
from .types import EngineConfig, EngineState, Shortfall
from .vec import to_resources, vadd
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


def ledgers(cy: CycleScratch, rows: list[NeedRow], state: EngineState, config: EngineConfig) -> Ledgers:
    """Unmet ages and parking from the Phase-1 deficit; shortfalls from what Phase 2 left short."""
    unmet: dict[str, int] = {}
    parking: dict[str, int] = {}
    short: dict[str, list[NeedRow]] = {}
    n_unsat = n_unresolved = 0
    for n in rows:
        unsat = any(n.p1_remaining)
        if n.same is not None and unsat:
            acquired = len(n.acquired_idle) + len(n.acquired_spec)
            if not (acquired > 0 or n.same_sat):
                parking[n.park_key] = n.park_age + 1
        if unsat:
            n_unsat += 1
            unmet[n.key] = n.unmet_age
        if any(n.remaining):
            short.setdefault(n.fp, []).append(n)
            n_unresolved += 1
    ages: dict[str, int] = {}
    shortfalls: list[Shortfall] = []
    for fp, ns in short.items():
        age = state.shortfall_ages.get(fp, 0) + 1
        ages[fp] = age
        deficit = cy.zero
        for n in ns:
            deficit = vadd(deficit, n.remaining)
        head = ns[0]
        shortfalls.append(Shortfall(
            fingerprint=fp,
            requirements=head.reqs,
            deficit=to_resources(cy.dims, deficit),
            priority=head.prio,
            age_cycles=age,
            interruption_bucket=head.ib,
            reason=unmet_reason(cy, head, True),
            clusters=tuple(sorted({n.cluster for n in ns})),
            escalated=age > config.escalation_after_cycles,
        ))
    shortfalls.sort(key=lambda s: (-s.priority, -s.age_cycles, s.fingerprint))
    return Ledgers(unmet, parking, ages, shortfalls[: max(0, config.shortfall_report_cap)], n_unsat, n_unresolved)
