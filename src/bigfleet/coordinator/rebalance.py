"""Cross-shard inventory rebalancing: which donor helps which aged shortfall (pure).

Demand-pull only: nothing moves unless a shard reports a shortfall older than
the escalation age. Tier 1 moves idle/speculative machines from a shard with
spare ones; tier 2 (last resort, older shortfalls only) asks a donor to drain
machines of strictly lower priority. A donor is never a shard that itself has
an unmet need of the same or higher priority, and one shard takes part in at
most one transfer at a time, with a cooldown after each that moved machines,
so machines do not oscillate between shards.

The coordinator only sees a donor's *count* of free machines, not their shapes
or the priorities of its busy ones, so a transfer can come back empty. Such a
transfer is remembered (:class:`FruitlessTransfer`) and that donor is not asked
again for the same shortfall at the same tier for a while. Without this memory
a donor with free machines of the wrong shape would be picked for tier 1 on
every tick, and tier 2 — the only way a higher priority gets capacity another
shard holds — would never fire.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

ESCALATION_AGE = 5
DRAIN_AGE = 12
# How long (seconds) an empty transfer keeps its donor out of the running for
# that shortfall and tier. Long enough for tier 2 to fire and finish its drain
# before tier 1 is probed again; short enough that a donor whose pool changed
# shape is asked again within minutes.
FRUITLESS_TTL = 300.0

KIND_INVENTORY = "inventory"
KIND_DRAIN = "drain"


@dataclass(frozen=True)
class ShortfallView:
    priority: int
    age_cycles: int
    requirements: list[dict[str, Any]] = field(default_factory=list)
    deficit: dict[str, str] = field(default_factory=dict)
    # The need's min unit: the donor moves or drains only machines whose allocatable holds one.
    min_unit: dict[str, str] = field(default_factory=dict)


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
    # The donor's free-machine count this plan acted on (the baseline for
    # forgetting a fruitless attempt once the donor has more free machines).
    donor_free: int = -1
    min_unit: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FruitlessTransfer:
    """A finished inventory or drain transfer that handed over no machine.

    ``donor_free`` is the donor's free count when it answered (-1: unknown).
    """

    kind: str
    donor: str
    recipient: str
    priority: int
    requirements: list[dict[str, Any]]
    ended_at: float  # seconds, same clock as ``now``
    donor_free: int = -1


def requirements_key(requirements: Iterable[Mapping[str, Any]]) -> str:
    """A canonical text form of a selector, so equal selectors compare equal whatever their key order."""
    return json.dumps([dict(r) for r in requirements], sort_keys=True, separators=(",", ":"))


def _blocked(
    fruitless: Iterable[FruitlessTransfer], views: Mapping[str, ShardView], now: float, ttl: float
) -> set[tuple[str, str, str, int, str]]:
    """(kind, donor, recipient, priority, selector) pairs not worth asking again yet.

    A memory lapses after ``ttl`` seconds. A tier-1 memory also lapses as soon
    as the donor reports more free machines than it had when it came back
    empty: the new ones may match. (A fall in its free count cannot add a
    matching machine, so it keeps the memory; a flapping count then cannot
    hold tier 2 off indefinitely.) A drain memory lapses by time only: the
    coordinator cannot see the priorities of a donor's busy machines.
    """
    out: set[tuple[str, str, str, int, str]] = set()
    for f in fruitless:
        if now - f.ended_at >= ttl:
            continue  # (an end stamped ahead of ``now`` by another leader's clock counts as fresh)
        d = views.get(f.donor)
        if f.kind == KIND_INVENTORY and d is not None and f.donor_free >= 0 and d.free_machines > f.donor_free:
            continue
        out.add((f.kind, f.donor, f.recipient, f.priority, requirements_key(f.requirements)))
    return out


def plan_inventory(
    shards: Iterable[ShardView],
    busy: Iterable[str] = (),
    cooling: Iterable[str] = (),
    escalation_age: int = ESCALATION_AGE,
    drain_age: int = DRAIN_AGE,
    donor_margin: int = 0,
    max_intents: int = 4,
    fruitless: Iterable[FruitlessTransfer] = (),
    now: float | None = None,
    fruitless_ttl: float = FRUITLESS_TTL,
) -> list[TransferIntent]:
    """The transfers to start now. ``now`` (seconds) is required with ``fruitless``."""
    fruitless = list(fruitless)
    if fruitless and now is None:
        raise ValueError("plan_inventory: now is required to age fruitless transfers")
    views = {s.shard_id: s for s in shards}
    blocked = _blocked(fruitless, views, now or 0.0, fruitless_ttl)
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
        sel = requirements_key(sf.requirements)

        def may_donate(d: ShardView, kind: str, prio: int = sf.priority, recipient: str = rid, sel: str = sel) -> bool:
            worst = d.max_unmet_priority()
            return (
                d.shard_id != recipient
                and d.shard_id not in taken
                and (worst is None or worst < prio)
                and (kind, d.shard_id, recipient, prio, sel) not in blocked
            )

        donors = [d for d in views.values() if may_donate(d, KIND_INVENTORY) and d.free_machines > donor_margin]
        if donors:
            d = max(donors, key=lambda d: (d.free_machines, d.shard_id))
            out.append(
                TransferIntent(KIND_INVENTORY, d.shard_id, rid, sf.priority, sf.requirements, sf.deficit, d.free_machines,
                               sf.min_unit)
            )
            taken.update((d.shard_id, rid))
            continue
        # No shard is left that might hold matching idle machines (none has free
        # ones, or every one that has came back empty): preempt, if old enough.
        if sf.age_cycles > drain_age:
            drainers = [d for d in views.values() if may_donate(d, KIND_DRAIN) and d.total_machines > 0]
            if drainers:
                d = max(drainers, key=lambda d: (d.total_machines, d.shard_id))
                out.append(
                    TransferIntent(KIND_DRAIN, d.shard_id, rid, sf.priority, sf.requirements, sf.deficit,
                                   d.free_machines, sf.min_unit)
                )
                taken.update((d.shard_id, rid))
    return out


def cooling_shards(last_finished: Mapping[str, float], now: float, cooldown: float) -> set[str]:
    """Shards whose last transfer ended less than ``cooldown`` seconds ago."""
    return {s for s, t in last_finished.items() if now - t < cooldown}
