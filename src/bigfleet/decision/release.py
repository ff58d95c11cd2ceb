"""Phase 3, release: Idle machines unclaimed past their hold go back to the provider.
"""

from __future__ import annotations

from bigfleet.machine.state import CapacityType

from .scratch import CycleScratch
from .types import (
    Action,
    Delete,
    EngineConfig,
)


def idle_releases(cy: CycleScratch, now: int, config: EngineConfig) -> list[Action]:
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
