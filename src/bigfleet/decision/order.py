"""The precedence order and the two Phase-1 passes that run in it (credit, then acquire).

Needs are processed in one total order (priority desc, interruption bucket desc, reclamation
bucket desc, arrival, cluster, fingerprint; `NeedRow.order`): the sequential equivalent of the
upstream broker's "as if one pass in priority order".
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import attrgetter, is_not

from bigfleet.needs import Need, NeedsTable
from bigfleet.needs.penalty import bucket_dollars

from .acquire import Plan, acquire_plan, acquire_spread, take_plan, take_plan_rows
from .credit import credit_cluster_bound, credit_plain, credit_reserved
from .index import CONFIGURED, CONFIGURING
from .same_domain import credit_same
from .scratch import CycleScratch, NeedRow
from .types import (
    EngineState,
)
from .vec import Vec


def needs_by_cluster(needs: Sequence[Need] | NeedsTable) -> dict[str, tuple[Need, ...]]:
    if isinstance(needs, NeedsTable):
        return {c: needs.cluster(c) for c in needs.clusters()}
    out: dict[str, list[Need]] = {}
    for n in needs:
        lst = out.get(n.cluster_id)
        if lst is None:
            out[n.cluster_id] = [n]
        else:
            lst.append(n)
    return {c: tuple(v) for c, v in out.items()}


_SAME = attrgetter("same")
_CLUSTER = attrgetter("cluster")


def credit_all(cy: CycleScratch, rows: list[NeedRow], state: EngineState, gangs_first: bool = False) -> None:
    """Pass 1: credit bound supply (and in-flight reservations) in precedence order.

    With `gangs_first`, within one priority level the Same gangs credit before plain needs: a plain
    need can use any matching machine, a gang only the ones in its domain, so letting the plain
    need go first can take a gang's own machines and make it re-acquire elsewhere (need swapping).

    A plain need's bound credit reads and holds only its own cluster's bound machines, so the plain
    rows of a cluster without gangs are credited together, cluster by cluster (one call each);
    what touches shared state (gangs, reservations) then runs in precedence order. That is the
    same result: a row's reservations come after its own bound credit either way, and bound
    credit never reads what reservations take.
    """
    if gangs_first and any(map(_SAME, rows)):  # (rows come in precedence order: without gangs, a no-op)
        rows = sorted(rows, key=lambda r: (-r.prio, r.same is None))  # stable: precedence order within
    ix = cy.ix
    bound, creating, reserved = ix.bound, ix.creating, ix.reserved_idle
    gang_clusters = set(map(_CLUSTER, compress(rows, map(is_not, map(_SAME, rows), repeat(None)))))
    by_cluster: dict[str, list[NeedRow]] = {}
    for n in rows:
        lst = by_cluster.get(n.cluster)
        if lst is None:
            by_cluster[n.cluster] = [n]
        else:
            lst.append(n)
    for c, cluster_rows in by_cluster.items():
        b = bound.get(c)
        if c not in gang_clusters and b and (b.get(CONFIGURED) or b.get(CONFIGURING)):
            credit_cluster_bound(cy, c, cluster_rows, b)
    if not (gang_clusters or creating or reserved):
        return
    for n in rows:
        if n.cluster in gang_clusters:
            _credit_in_order(cy, n, state)
        elif (creating.get(n.fp) or reserved.get(n.fp)) and any(n.remaining):
            credit_reserved(cy, n)


def _credit_in_order(cy: CycleScratch, n: NeedRow, state: EngineState) -> None:
    """One row of a cluster with gangs: a gang, or a plain row credited need by need."""
    if n.same is not None:
        credit_same(cy, n, state.same_domains.get(n.park_key))
        return
    # A plain need of a cluster with nothing bound, and nothing in flight for its fingerprint,
    # has nothing to credit (every need of a bootstrapping cluster): skip the call.
    ix = cy.ix
    b = ix.bound.get(n.cluster)
    if (b and (b.get(CONFIGURED) or b.get(CONFIGURING))) or ix.creating.get(n.fp) or ix.reserved_idle.get(n.fp):
        credit_plain(cy, n)


def acquire_all(cy: CycleScratch, rows: list[NeedRow]) -> None:
    """Pass 2: acquire Idle then Speculative for what is left, in precedence order. A plain need's
    plan depends only on its requirements, MinUnit and interruption bucket (memoised by fingerprint).
    Consecutive plain rows with one plan (the many one-pod needs of one shape, cluster after cluster)
    are taken as one run; any other row first ends the run, so the order of takes is unchanged."""
    plans: dict[tuple[str, Vec], Plan] = {}
    #: (the gang's domain list, its chosen domain, interruption bucket) → that domain's plan
    gang_plans: dict[tuple[int, str, int], Plan] = {}
    run: list[NeedRow] = []
    run_plan: Plan = []
    for n in rows:
        if not any(n.remaining) or n.parked:
            continue
        if n.same is None and not n.spreads:
            pk = (n.fp, n.minu)
            plan = plans.get(pk)
            if plan is None:
                plan = plans[pk] = acquire_plan(cy, cy.eligible(n), bucket_dollars(n.ib))
            if plan is not run_plan:
                if run:
                    take_plan_rows(cy, run, run_plan)
                run, run_plan = [], plan
            run.append(n)
            continue
        if run:
            take_plan_rows(cy, run, run_plan)
            run = []
        if n.same is None:
            acquire_spread(cy, n, cy.eligible(n), bucket_dollars(n.ib))
        elif n.same_domain:
            domains = cy.domains(n, n.same.key)
            gk = (id(domains), n.same_domain, n.ib)  # (the list lives as long as the scratch)
            plan = gang_plans.get(gk)
            if plan is None:
                dom_classes = next((cl for v, cl in domains if v == n.same_domain), [])
                plan = gang_plans[gk] = acquire_plan(cy, dom_classes, bucket_dollars(n.ib))
            take_plan(cy, n, plan)
    if run:
        take_plan_rows(cy, run, run_plan)
