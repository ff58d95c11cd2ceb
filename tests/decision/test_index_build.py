"""`build_index` from an `Inventory`'s (state, shape) groups equals the machine-by-machine build, and
its C-level sorts order exactly as the `pool_key`/`keep_key` tie-breaks do."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bigfleet.decision import EngineConfig, EngineState, decide
from bigfleet.decision.index import Index, build_index, keep_key, pool_key
from bigfleet.machine import Inventory, Machine, MachineState

from .fx import NOW, machine
from .test_engine_properties import CLUSTERS, SETTINGS, machines, needs

S = MachineState


def _ids(lst: list[Machine]) -> list[str]:
    return [m.id for m in lst]


def _view(ix: Index) -> dict[str, object]:
    """Everything the index holds, by machine id (class numbering is canonical in both builds)."""
    return {
        "classes": [c.shape for c in ix.classes],
        "pool": {k: _ids(v) for k, v in ix.pool.items()},
        "bound": {c: {st: {ci: _ids(v) for ci, v in by.items()} for st, by in sb.items()} for c, sb in ix.bound.items()},
        "creating": {k: _ids(v) for k, v in ix.creating.items()},
        "reserved_idle": {k: _ids(v) for k, v in ix.reserved_idle.items()},
        "configured_by_class": {k: _ids(v) for k, v in ix.configured_by_class.items()},
        "draining_by_class": {k: _ids(v) for k, v in ix.draining_by_class.items()},
        "idle_by_type": {k: _ids(v) for k, v in ix.idle_by_type.items()},
        "configured_count": ix.configured_count,
        "free_count": ix.free_count,
        "pool_clustered": ix.pool_clustered,
        "total": ix.total,
    }


def _inventory_groups(inv: Inventory) -> list[tuple[MachineState, object, object]]:
    return [(st, shape, group) for st in MachineState for shape, group in inv.by_state(st).by_shape()]


@SETTINGS
@given(machines(), needs(), st.frozensets(st.sampled_from(CLUSTERS)), st.randoms())
def test_grouped_build_equals_machine_by_machine(ms: list[Machine], ns: list, ready: frozenset[str],
                                                 rnd: random.Random) -> None:
    shuffled = list(ms)
    rnd.shuffle(shuffled)
    inv = Inventory(shuffled)
    assert _view(build_index(inv.machines(), _inventory_groups(inv))) == _view(build_index(ms))  # type: ignore[arg-type]
    in_order = Inventory(sorted(ms, key=lambda m: m.id))  # (its groups say they are id-ordered: no sort)
    assert _view(build_index(in_order.machines(), _inventory_groups(in_order))) == _view(build_index(ms))  # type: ignore[arg-type]
    state = EngineState(first_rollup=ready)
    assert decide(ns, inv, NOW, state, EngineConfig()) == decide(ns, list(ms), NOW, state, EngineConfig())


def test_odd_penalties_sort_as_the_key_functions() -> None:
    """NaN and negative stamps count as 0 (`m_reclamation`); the C-level sorts must agree."""
    pens = [float("nan"), -3.0, 0.0, 5.0, 2.0, 5.0, -0.0, 1.0]
    ms = [machine(f"i{i}", S.IDLE, rpd=p) for i, p in enumerate(pens)]
    ms += [machine(f"c{i}", S.CONFIGURED, cluster="c0", rpd=p) for i, p in enumerate(pens)]
    plain = [machine(f"p{i}", S.CONFIGURED, cluster="c1", rpd=p) for i, p in enumerate([3.0, 0.0, 3.0, 7.0])]
    ix = build_index(reversed(ms + plain))
    (pool,) = ix.pool.values()
    assert _ids(pool) == _ids(sorted(pool, key=pool_key))
    for cluster in ("c0", "c1"):
        (lst,) = ix.bound[cluster][int(S.CONFIGURED)].values()
        assert _ids(lst) == _ids(sorted(lst, key=keep_key))
    for order in (ms + plain, list(reversed(ms + plain))):  # (groups' penalty stamps known, no record read)
        inv = Inventory(order)
        assert _view(build_index(inv.machines(), _inventory_groups(inv))) == _view(ix)  # type: ignore[arg-type]


def test_cluster_parts_equal_groupby_for_long_and_short_runs() -> None:
    """The cold build cuts a class's bound machines into per-cluster parts by binary search when
    runs are long and by `groupby` when they are short: the same parts either way."""
    from itertools import groupby

    from bigfleet.decision.index import _cluster_parts, _long_runs

    rnd = random.Random(3)
    seen = set()
    for _ in range(200):
        clusters = [f"c{i:03d}" for i in range(rnd.choice((1, 2, 5, 40, 400)))]
        n = rnd.choice((1, 10, 63, 64, 65, 300, 2000))
        ms = sorted((machine(f"m{i:04d}", S.CONFIGURED, cluster=rnd.choice(clusters)) for i in range(n)),
                    key=lambda m: m.cluster)
        want = [(c, _ids(list(p))) for c, p in groupby(ms, lambda m: m.cluster)]
        assert [(c, _ids(p)) for c, p in _cluster_parts(ms)] == want
        seen.add(n >= 64 and _long_runs(ms))
    assert seen == {True, False}  # both paths ran


@pytest.mark.parametrize(("run", "long"), [(1, False), (2, False), (3, False), (4, False), (8, False),
                                           (32, True), (100, True)])
def test_long_runs_reads_run_length_whatever_the_alignment(run: int, long: bool) -> None:
    """Runs of one length line up with any even stride; the check must still see them as short
    (runs of 2 once took the per-run binary search in 60 of aggregated-500k's 320 classes)."""
    from bigfleet.decision.index import _long_runs

    for n in (64, 65, 300, 1400, 1401, 2000):
        ms = [machine(f"m{i:05d}", S.CONFIGURED, cluster=f"c{i // run:05d}") for i in range(n)]
        assert _long_runs(ms) is long, (run, n)
