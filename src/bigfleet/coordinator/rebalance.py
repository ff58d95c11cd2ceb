"""Cross-shard inventory rebalancing: which donor helps which aged shortfall (pure).

Demand-pull only: nothing moves unless a shard reports a shortfall older than
the escalation age. Tier 1 moves idle/speculative machines from a shard with
spare ones; tier 2 (last resort, older shortfalls only) asks a donor to drain
machines of strictly lower priority. A donor is never a shard that itself has
an unmet need of the same or higher priority, and one shard takes part in at
most one transfer at a time, with a cooldown after each, so machines do not
oscillate between shards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

ESCALATION_AGE = 5
DRAIN_AGE = 12


@dataclass(frozen=True)
class ShortfallView:
    priority: int
    age_cycles: int
    requirements: list[dict[str, Any]] = field(default_factory=list)
    deficit: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardView:
    shard_id: str
    free_machines: int
    total_machines: int
    shortfalls: list[ShortfallView] = field(default_factory=list)

    def max_unmet_priority(self) -> int | None:
        return max((s.priority for s in self.shortfalls), default=None)


@dataclass(frozen=True)
class TransferIntent:
    kind: str  # "inventory" or "drain"
    donor: str
    recipient: str
    priority: int
    requirements: list[dict[str, Any]]
    deficit: dict[str, str]


def plan_inventory(
    shards: Iterable[ShardView],
    busy: Iterable[str] = (),
    cooling: Iterable[str] = (),
    escalation_age: int = ESCALATION_AGE,
    drain_age: int = DRAIN_AGE,
    donor_margin: int = 0,
    max_intents: int = 4,
) -> list[TransferIntent]:
    views = {s.shard_id: s for s in shards}
    taken = set(busy) | set(cooling)
    needs: list[tuple[int, int, str, ShortfallView]] = []
    for v in views.values():
        eligible = [s for s in v.shortfalls if s.age_cycles > escalation_age]
        if eligible:
            top = max(eligible, key=lambda s: (s.priority, s.age_cycles))
            needs.append((-top.priority, -top.age_cycles, v.shard_id, top))
    needs.sort(key=lambda n: (n[0], n[1], n[2]))
    out: list[TransferIntent] = []
    for _, _, rid, sf in needs:
        if len(out) >= max_intents:
            break
        if rid in taken:
            continue

        def may_donate(d: ShardView, prio: int = sf.priority, recipient: str = rid) -> bool:
            worst = d.max_unmet_priority()
            return d.shard_id != recipient and d.shard_id not in taken and (worst is None or worst < prio)

        donors = [d for d in views.values() if may_donate(d) and d.free_machines > donor_margin]
        if donors:
            d = max(donors, key=lambda d: (d.free_machines, d.shard_id))
            out.append(TransferIntent("inventory", d.shard_id, rid, sf.priority, sf.requirements, sf.deficit))
            taken.update((d.shard_id, rid))
            continue
        if sf.age_cycles > drain_age:
            drainers = [d for d in views.values() if may_donate(d) and d.total_machines > 0]
            if drainers:
                d = max(drainers, key=lambda d: (d.total_machines, d.shard_id))
                out.append(TransferIntent("drain", d.shard_id, rid, sf.priority, sf.requirements, sf.deficit))
                taken.update((d.shard_id, rid))
    return out


def cooling_shards(last_finished: Mapping[str, float], now: float, cooldown: float) -> set[str]:
    """Shards whose last transfer ended less than ``cooldown`` seconds ago."""
    return {s for s, t in last_finished.items() if now - t < cooldown}
