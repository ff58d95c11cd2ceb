"""Phase 3, reclaim: a cluster's Configured machines credited to no need drain, capped per cycle.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Mapping, Sequence
from itertools import islice
from typing import Protocol

from bigfleet.machine.record import Machine

from .index import (
    CONFIGURED,
    m_reclamation,
)
from .scratch import CycleScratch
from .types import (
    Action,
    Drain,
    EngineConfig,
    EngineState,
)


def _reclaim_desc_key(m: Machine) -> tuple[float, float, str]:
    return (-m_reclamation(m), m.shape.price_per_hour, m.id)


def excess_drains(cy: CycleScratch, cluster: str, grace: int, limit: int, exclude: set[str]) -> tuple[list[Drain], int]:
    """The first `limit` reclaim drains of the cluster's unclaimed Configured machines, cheapest to
    lose first (reclamation asc, price desc, id desc), and how many such machines there are.

    Each class list is kept in keep order, so its unclaimed tail read backwards is already in reclaim
    order; a lazy merge produces only the head the cap lets through.
    """
    by_class = cy.ix.bound.get(cluster, {}).get(CONFIGURED, {})
    held = cy.held.get(cluster) or {}
    total = cy.ix.configured_count.get(cluster, 0) - cy.hconf.get(cluster, 0)
    if exclude:
        total -= sum(1 for lst in by_class.values() for m in lst if m.id in exclude and m.id not in held)
    if total <= 0 or limit <= 0:
        return [], max(0, total)

    def tail(lst: list[Machine]) -> Iterator[Machine]:
        for m in reversed(lst):
            if m.id not in held and m.id not in exclude:
                yield m

    lists = list(by_class.values())
    stream: Iterator[Machine] = tail(lists[0]) if len(lists) == 1 else heapq.merge(
        *(tail(lst) for lst in lists), key=_reclaim_desc_key, reverse=True)
    return [Drain(m.id, cluster, grace, 0, "reclaim") for m in islice(stream, limit)], total


def reclaim_cap(configured: int, fraction: float) -> int:
    return max(1, math.floor(fraction * configured)) if fraction > 0 else configured


class ReclaimMemo(Protocol):
    """A cached cluster's reclaim drains, reusable while its (grace, cap fraction) is unchanged."""

    drains: tuple[tuple[int, float], list[Drain], int] | None


def reclaim_all(cy: CycleScratch, state: EngineState, config: EngineConfig, preempts: Sequence[Action],
                memos: Mapping[str, ReclaimMemo], needs_of: Mapping[str, object]) -> tuple[list[Action], int]:
    """Phase 3 reclaims of every cluster (id order) whose first roll-up was seen; and how many more
    were excess but deferred by the cap. Phase-2 victims are not excess again.

    A cached cluster's configured count is fixed while it stays cached, so its drains are keyed on
    the grace and cap fraction alone; most clusters cost two dict lookups here.
    """
    victims_by_cluster: dict[str, set[str]] = {}
    for a in preempts:
        if isinstance(a, Drain):
            victims_by_cluster.setdefault(a.cluster_id, set()).add(a.machine_id)
    grace, frac = config.reclaim_grace_seconds, config.reclaim_cap_fraction
    first, counts = state.first_rollup, cy.ix.configured_count
    reclaims: list[Action] = []
    deferred = 0
    no_victims: set[str] = set()
    for c in sorted(counts):
        if c not in first:
            continue
        excl = victims_by_cluster.get(c, no_victims)
        memo = memos.get(c)
        if memo is not None and not excl and c in needs_of:
            dr = memo.drains
            if dr is None or dr[0] != (grace, frac):
                d_list, d_total = excess_drains(cy, c, grace, reclaim_cap(counts[c], frac), excl)
                dr = memo.drains = ((grace, frac), d_list, d_total)
            drains, total = dr[1], dr[2]
        else:
            drains, total = excess_drains(cy, c, grace, reclaim_cap(counts[c], frac), excl)
        if total:
            reclaims.extend(drains)
            deferred += total - len(drains)
    return reclaims, deferred
