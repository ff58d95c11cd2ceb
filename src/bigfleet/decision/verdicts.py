"""Per-need verdicts (why a need is or is not met) and fast builders for the frozen records.
"""

from __future__ import annotations

from bigfleet.needs import EMPTY, Resources

from .index import (
    IDLE,
    SPEC,
)
from .scratch import CycleScratch, NeedRow
from .types import (
    MatchingSupply,
    UnmetReason,
    Verdict,
)
from .vec import Vec, to_resources


def _matching_supply(cy: CycleScratch, n: NeedRow) -> MatchingSupply:
    """Idle, Speculative and Configured machines of the need's eligible classes (the index does not
    change within a cycle, so one count per eligible-class list serves every need sharing it)."""
    classes = cy.eligible(n)
    hit = cy.supply_memo.get(id(classes))
    if hit is not None and hit[0] is classes:
        return hit[1]
    idle = spec = conf = 0
    for c in classes:
        idle += len(cy.ix.pool.get((IDLE, c.idx), ()))
        spec += len(cy.ix.pool.get((SPEC, c.idx), ()))
        conf += len(cy.ix.configured_by_class.get(c.idx, ()))
    got = MatchingSupply(idle=idle, configured=conf, speculative=spec, capped=False)
    cy.supply_memo[id(classes)] = (classes, got)
    return got


def unmet_reason(cy: CycleScratch, n: NeedRow, unsat: bool, supply: MatchingSupply | None = None) -> UnmetReason:
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


def _resources(cy: CycleScratch, v: Vec) -> Resources:
    """One (immutable) record per distinct deficit in a cycle: short needs mostly share a few, and
    a reused cluster copies its verdicts every cycle, touching each one's deficit."""
    got = cy.resources_memo.get(v)
    if got is None:
        got = cy.resources_memo[v] = to_resources(cy.dims, v)
    return got


#: the fields of a met need's verdict that do not come from its row, in `need_verdicts`' key order
_MET: dict[str, object] = {
    "satisfied": True, "deficit": EMPTY, "claimed_count": 0, "bootstrap_count": 0, "provision_count": 0,
    "same_domain": "", "same_satisfiable": False, "parked": False, "parked_age_cycles": 0, "unmet_since": -1,
    "unmet_reason": UnmetReason.SATISFIED, "matching_supply": _NO_SUPPLY, "victims_found": 0,
    "capacity_freed": None, "folded_into": "", "claimed_configured": 0, "cluster_id": "", "fingerprint": "",
}
_new = object.__new__
_set_attr = object.__setattr__


def _verdict(fields: dict[str, object]) -> Verdict:
    """A `Verdict` holding `fields` (every field, none other) as its attribute dict: no copy, and
    equality, hash and repr as if built by `__init__`."""
    v: Verdict = _new(Verdict)
    _set_attr(v, "__dict__", fields)
    return v


def need_verdicts(cy: CycleScratch, n: NeedRow, unsat: bool) -> list[Verdict]:
    supply = _matching_supply(cy, n) if unsat else _NO_SUPPLY
    members = n.members
    folded = len(members) > 1 or members[0] is not n.need
    deficit = _resources(cy, n.p1_remaining) if unsat else EMPTY
    reason = unmet_reason(cy, n, unsat, supply) if unsat else UnmetReason.SATISFIED
    freed = to_resources(cy.dims, n.freed) if n.victims else None
    into = n.fp if folded else ""
    common = {
        "satisfied": not unsat, "deficit": deficit, "claimed_count": len(n.claimed),
        "bootstrap_count": len(n.acquired_idle), "provision_count": len(n.acquired_spec),
        "same_domain": n.same_domain, "same_satisfiable": n.same_sat, "parked": n.parked,
        "parked_age_cycles": n.park_age, "unmet_since": cy.cycle - n.unmet_age if unsat else -1,
        "unmet_reason": reason, "matching_supply": supply, "victims_found": n.victims,
        "capacity_freed": freed, "folded_into": into,
        "claimed_configured": n.conf_credited, "cluster_id": "", "fingerprint": "",
    }
    out = []
    for m in members:
        fields = common.copy()
        fields["cluster_id"] = m.cluster_id
        fields["fingerprint"] = m.profile._fingerprint
        out.append(_verdict(fields))
    return out


def rows_verdicts(cy: CycleScratch, rows: list[NeedRow]) -> list[Verdict]:
    """The verdicts of `rows` in row order (each row's members in order). A met row of one plain,
    unfolded need (most of a cycle's) is a copy of one template with its own six fields set: its
    gang, preemption, unmet and folding fields all hold their defaults."""
    out: list[Verdict] = []
    for n in rows:
        if any(n.p1_remaining):
            out += need_verdicts(cy, n, True)
            continue
        members = n.members
        if n.same is not None or n.victims or len(members) > 1 or members[0] is not n.need:
            out += need_verdicts(cy, n, False)
            continue
        fields = _MET.copy()
        fields["claimed_count"] = len(n.claimed)
        fields["bootstrap_count"] = len(n.acquired_idle)
        fields["provision_count"] = len(n.acquired_spec)
        fields["claimed_configured"] = n.conf_credited
        fields["cluster_id"] = n.cluster
        fields["fingerprint"] = n.fp
        out.append(_verdict(fields))
    return out
