"""Phase-1 credit plans: the runs a need credits from equal the reference `_keep_runs` order."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bigfleet.decision.credit import _cluster_plans, _keep_runs, _state_runs, bound_lists
from bigfleet.decision.index import CONFIGURED, CONFIGURING, build_index
from bigfleet.decision.scratch import CycleScratch, NeedRow, RowMaker
from bigfleet.machine import Inventory, Machine, MachineState
from bigfleet.needs import Need, Operator, Profile, Requirement

from .fx import TYPE_KEY, machine
from .test_engine_properties import CLUSTERS, g

S = MachineState
DIMS = ("nvidia.com/gpu",)
ODD = (float("nan"), -1.0)


@st.composite
def bound_fleet(draw: st.DrawFn) -> list[Machine]:
    """Bound machines of few shapes, many per class, one or several stamps per class (sometimes odd)."""
    odd = draw(st.booleans())
    stamps = st.sampled_from((0.0, 8.0, 512.0) + (ODD if odd else ()))
    uniform = draw(st.booleans())  # one stamp per (cluster, class): the C-level class sort
    prices = (1.0, 2.0) if draw(st.booleans()) else (1.0,)  # one price and size: the mixed-stamp sort
    sizes = (1, 2) if draw(st.booleans()) else (1,)
    fixed: dict[tuple[str, str, str, float, int], float] = {}
    out = []
    for i in range(draw(st.integers(1, 60))):
        cluster = draw(st.sampled_from(CLUSTERS[:2]))
        shape = (cluster, draw(st.sampled_from(("t0", "t1"))), draw(st.sampled_from("ab")),
                 draw(st.sampled_from(prices)), draw(st.sampled_from(sizes)))
        rpd = fixed.setdefault(shape, draw(stamps)) if uniform else draw(stamps)
        out.append(machine(f"m{i:02d}", draw(st.sampled_from((S.CONFIGURED, S.CONFIGURED, S.CONFIGURING))),
                           cluster=cluster, itype=shape[1], zone=shape[2], price=shape[3], res=g(shape[4]), rpd=rpd))
    return out


def _need(cluster: str, types: tuple[str, ...], minu: int) -> NeedRow:
    reqs = [Requirement(TYPE_KEY, Operator.IN, types)] if types else []
    n = Need(cluster, Profile.build(reqs, priority=100), g(4), g(minu), 1)
    rm = RowMaker(DIMS)
    return rm.row(n, [n], rm.info(n.profile))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bound_fleet(), st.sampled_from(((), ("t0",), ("t1",), ("t0", "t1"))), st.integers(1, 2))
def test_plan_runs_equal_the_reference_keep_runs(ms: list[Machine], types: tuple[str, ...], minu: int) -> None:
    ix = build_index(Inventory(ms))
    cy = CycleScratch(ix, DIMS, {})
    for cluster in CLUSTERS:
        n = _need(cluster, types, minu)
        for state in (CONFIGURED, CONFIGURING):
            by_class = ix.bound.get(cluster, {}).get(state)
            if not by_class:
                continue
            got = [(r.alloc, r.ms[r.cur:r.end], r.ids[r.cur:r.end]) for r in
                   _state_runs(cy, n, state, by_class, cy.eligible_set(n))]
            lists = bound_lists(cy, n, state)
            want = [(a, run, [m.id for m in run]) for a, run in _keep_runs(cy, lists)] if lists else []
            assert got == want


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bound_fleet(), st.sampled_from(((), ("t0",), ("t1",), ("t0", "t1"))), st.integers(1, 2))
def test_cluster_plan_runs_equal_the_reference_keep_runs(ms: list[Machine], types: tuple[str, ...], minu: int
                                                         ) -> None:
    """The per-cluster plans, built from an inventory's groups (so the index knows the classes'
    stamps where each has one) and asked twice per cluster (the second time, and for clusters
    holding the same classes, from the cycle's selection memo), run in the reference order."""
    inv = Inventory(ms)
    ix = build_index(inv.machines(), [(s, shape, grp) for s in MachineState for shape, grp in inv.by_state(s).by_shape()])
    cy = CycleScratch(ix, DIMS, {})
    for cluster in CLUSTERS * 2:
        bound = ix.bound.get(cluster)
        if not bound:
            continue
        n = _need(cluster, types, minu)
        plans = _cluster_plans(cy, [n], bound)
        assert plans is not None  # (one need: nothing can overlap)
        got = [(conf, [(r.alloc, r.ms[r.cur:]) for r in runs]) for conf, runs in plans[0]]
        want = []
        for state in (CONFIGURED, CONFIGURING):
            lists = bound_lists(cy, n, state)
            if lists:
                want.append((state == CONFIGURED, [(a, run) for a, run in _keep_runs(cy, lists)]))
        assert got == want


def test_a_selection_is_per_state() -> None:
    """Same classes in both states, one stamp throughout in Configured but two in Configuring: the
    Configuring run must still follow the stamps (a selection memo shared across states would not)."""
    ms = [machine(f"a{i}", S.CONFIGURED, cluster="c0", itype="t0", zone=z, rpd=0.0) for i, z in enumerate("ab")]
    ms += [machine(f"b{i}", S.CONFIGURING, cluster="c0", itype="t0", zone=z, rpd=r)
           for i, (z, r) in enumerate((("a", 0.0), ("b", 8.0)))]
    inv = Inventory(ms)
    ix = build_index(inv.machines(), [(s, shape, grp) for s in MachineState for shape, grp in inv.by_state(s).by_shape()])
    cy = CycleScratch(ix, DIMS, {})
    n = _need("c0", ("t0",), 1)
    plans = _cluster_plans(cy, [n], ix.bound["c0"])
    assert plans is not None
    assert [(conf, [[m.id for m in r.ms] for r in runs]) for conf, runs in plans[0]] == [
        (True, [["a0", "a1"]]), (False, [["b1", "b0"]])]


def test_clusters_holding_the_same_classes_share_their_selections(monkeypatch: pytest.MonkeyPatch) -> None:
    """A count gate, not a clock: 40 clusters over the same two types × three zones, each with a need
    per type. Each (classes, eligible set) pair is selected once a cycle, not once per cluster; and
    every need is met from its own machines, as without sharing."""
    from bigfleet.decision import EngineConfig, EngineState, decide
    from bigfleet.decision import credit as credit_mod

    calls = []
    real = credit_mod._selection

    def counting(*args: object) -> object:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(credit_mod, "_selection", counting)
    ms, ns = [], []
    for c in range(40):
        cluster = f"k{c:02d}"
        for t in ("t0", "t1"):
            ms += [machine(f"{cluster}-{t}-{z}", S.CONFIGURED, cluster=cluster, itype=t, zone=z, res=g(1), rpd=2.0)
                   for z in ("a", "b", "c")]
            ns.append(Need(cluster, Profile.build([Requirement(TYPE_KEY, Operator.IN, (t,))], priority=10),
                           g(3), g(1), 1))
    d = decide(ns, Inventory(ms), 0, EngineState(first_rollup=frozenset(n.cluster_id for n in ns)), EngineConfig())
    assert len(calls) == 2  # (one layout of classes, two eligible sets)
    assert all(v.satisfied and v.claimed_count == 3 for v in d.verdicts) and not d.actions
