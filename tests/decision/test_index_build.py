"""`build_index` from an `Inventory`'s (state, shape) groups equals the machine-by-machine build, and
its C-level sorts order exactly as the `pool_key`/`keep_key` tie-breaks do."""

from __future__ import annotations

import operator
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


@pytest.mark.parametrize("mixed_stamps", [True, False])
@pytest.mark.parametrize("grouped_ids", [True, False])
@pytest.mark.parametrize("run", [1, 2, 3, 17, 200])
def test_bound_lists_are_each_clusters_machines_in_keep_order(mixed_stamps: bool, grouped_ids: bool, run: int
                                                              ) -> None:
    """The cold build splits a class's bound machines by cluster and files the parts with C-level
    maps: every list must be its cluster's machines of that class and state in keep order, whatever
    the run lengths, with machines of no cluster left out and the Configured counts summed."""
    rnd = random.Random(run)
    ms = []
    for i in range(600):
        cluster = "" if i % 97 == 0 else f"c{i // run:04d}"
        mid = f"{cluster or 'zz'}-{i:04d}" if grouped_ids else f"m{rnd.randrange(10**9):09d}-{i}"
        ms.append(machine(mid, S.CONFIGURED if i % 5 else S.CONFIGURING, cluster=cluster,
                          rpd=float(rnd.choice((0, 0, 1, 3)) if mixed_stamps else 2)))
    rnd.shuffle(ms)
    ix = build_index(ms)
    want: dict[str, dict[int, dict[int, list[str]]]] = {}
    for m in sorted(ms, key=keep_key):
        if m.cluster:
            want.setdefault(m.cluster, {}).setdefault(int(m.state), {}).setdefault(ix.class_of_shape[m.shape], []).append(m.id)
    got = {c: {st: {ci: _ids(lst) for ci, lst in by.items()} for st, by in sb.items()} for c, sb in ix.bound.items()}
    assert got == want
    for sb in ix.bound.values():  # (classes in class order within a cluster, as the incremental path files them)
        for by in sb.values():
            assert list(by) == sorted(by)
    conf = {c: sum(map(len, sb.get(int(S.CONFIGURED), {}).values())) for c, sb in ix.bound.items()}
    assert ix.configured_count == {c: k for c, k in conf.items() if k}


@pytest.mark.parametrize("c_key", [True, False])
def test_remove_many_takes_any_group_whatever_its_order(c_key: bool) -> None:
    """A wave's groups are usually a list's last records, in order or reversed (removed by an
    identity check alone); any other group, a copy of a listed record, or a record not listed, goes
    the general way (and a missing one raises)."""
    from bigfleet.decision.index import _ID, _remove_many

    rnd = random.Random(11)
    for _ in range(300):
        lst = [machine(f"m{i:03d}", S.CONFIGURED, cluster="a") for i in range(rnd.randint(1, 60))]
        k = rnd.randint(1, len(lst))
        shape = rnd.choice(("tail", "reversed", "random"))
        grp = lst[-k:] if shape == "tail" else lst[-k:][::-1] if shape == "reversed" else rnd.sample(lst, k)
        want = [m for m in lst if all(m is not g for g in grp)]
        got = list(lst)
        _remove_many(got, grp, _ID, c_key)
        assert got == want and all(map(operator.is_, got, want))
    lst = [machine(f"m{i}", S.CONFIGURED, cluster="a") for i in range(4)]
    with pytest.raises(KeyError):
        _remove_many(list(lst), [lst[3].replace(state=S.CONFIGURED), lst[2]], _ID, c_key)


def _known_stamps_hold(ix: Index) -> int:
    """Every class stamp the index says it knows is every bound record's of that class and state;
    returns how many (state, class) stamps are known."""
    known = 0
    for sti, stamps in ix.bound_stamp.items():
        known += len(stamps)
        for by_state in ix.bound.values():
            for ci, lst in by_state.get(sti, {}).items():
                if ci in stamps:
                    assert [m.assignment.reclamation_penalty_dollars for m in lst] == [stamps[ci]] * len(lst)
    return known


@SETTINGS
@given(machines(), st.randoms())
def test_known_class_stamps_hold_through_incremental_changes(ms: list[Machine], rnd: random.Random) -> None:
    """The cold build knows a class's one stamp from the inventory's distinct assignments (credit
    then reads no record for it); records added later, batched or one by one, with another stamp
    must make it forget that stamp."""
    from bigfleet.decision.index import add_machine, apply_changes

    inv = Inventory(ms)
    ix = build_index(inv.machines(), _inventory_groups(inv))  # type: ignore[arg-type]
    _known_stamps_hold(ix)
    # copies of the fleet's records (same shapes, so same classes) under new ids, some restamped
    fresh = [m.replace(id=f"n{i:02d}", assigned_reclamation_penalty_dollars=rnd.choice(
        (m.assignment.reclamation_penalty_dollars, 0.0, 8.0))) for i, m in enumerate(rnd.sample(ms, len(ms)))]
    k = rnd.randint(0, len(fresh))
    apply_changes(ix, [], fresh[:k])
    _known_stamps_hold(ix)
    for m in fresh[k:]:
        add_machine(ix, m)
        _known_stamps_hold(ix)


def test_a_class_of_one_stamp_is_known_and_forgotten_when_another_joins() -> None:
    from bigfleet.decision.index import add_machine, apply_changes

    ms = [machine(f"m{i}", S.CONFIGURED, cluster=f"c{i % 3}", rpd=8.0) for i in range(9)]
    inv = Inventory(ms)
    ix = build_index(inv.machines(), _inventory_groups(inv))  # type: ignore[arg-type]
    ci = ix.class_of_shape[ms[0].shape]
    assert ix.bound_stamp == {int(S.CONFIGURED): {ci: 8.0}}
    assert build_index(ms).bound_stamp == {}  # (records alone: not known without reading them)
    apply_changes(ix, [], [machine("n0", S.CONFIGURED, cluster="c1", rpd=8.0)])
    assert ix.bound_stamp == {int(S.CONFIGURED): {ci: 8.0}}
    add_machine(ix, machine("n1", S.CONFIGURED, cluster="c2", rpd=1.0))
    assert ix.bound_stamp == {int(S.CONFIGURED): {}}
    ix2 = build_index(inv.machines(), _inventory_groups(inv))  # type: ignore[arg-type]
    apply_changes(ix2, [], [machine("n2", S.CONFIGURED, cluster="c0", rpd=0.0)])
    assert ix2.bound_stamp == {int(S.CONFIGURED): {}}
