"""Inventory: validated writes, transitions, and indexes that never disagree with the records."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigfleet.machine import (
    ZONE_LABEL,
    DuplicateMachine,
    IllegalTransition,
    Inventory,
    MachineState,
    UnknownMachine,
    ValidationError,
    can_transition,
)

from .helpers import valid_machine

S = MachineState


def check_indexes(inv: Inventory) -> None:
    """Every index agrees with the id map: each machine is in exactly the buckets its fields say."""
    all_ms = {m.id: m for m in inv}
    assert len(all_ms) == len(inv)
    seen = 0
    for s in S:
        for m in inv.by_state(s):
            assert m.state is s and all_ms[m.id] is m
            seen += 1
    assert seen == len(inv)
    assert sum(inv.counts().values()) == len(inv)
    for c in inv.clusters():
        bound = inv.by_cluster(c)
        assert bound and all(m.cluster == c and all_ms[m.id] is m for m in bound)
    assert sum(len(inv.by_cluster(c)) for c in inv.clusters()) == sum(1 for m in inv if m.cluster)
    assert sum(n for _, n in inv.label_sets()) == len(inv)
    for s in S:  # a group that says it iterates in id order does
        for _, group in inv.by_state(s).by_shape():
            ids = [m.id for m in group]
            assert len(group) == len(ids) and all(m in group for m in group)
            if group.id_ordered:
                assert ids == sorted(ids)
            stamps = [m.assignment.reclamation_penalty_dollars for m in group]  # (NaN counted once)
            want = {p for p in stamps if p == p} | ({"nan"} if any(p != p for p in stamps) else set())
            assert {p if p == p else "nan" for p in group.reclamation_penalties} == want


def test_add_get_remove() -> None:
    inv = Inventory()
    m = inv.add(valid_machine("a", S.IDLE))
    assert inv.get("a") is m and inv["a"] is m and "a" in inv and len(inv) == 1
    with pytest.raises(DuplicateMachine):
        inv.add(valid_machine("a", S.IDLE))
    with pytest.raises(ValidationError):
        inv.add(valid_machine("b", S.CONFIGURED, cluster=""))
    assert "b" not in inv
    assert inv.remove("a") is m and inv.remove("a") is None
    with pytest.raises(UnknownMachine):
        inv["a"]
    assert inv.get("a") is None and len(inv) == 0
    check_indexes(inv)


def test_full_lifecycle_through_transitions() -> None:
    inv = Inventory([valid_machine("m", S.SPECULATIVE)])
    inv.transition("m", S.CREATING, 1)
    inv.transition("m", S.IDLE, 2, host_provider="fake", host_ref="h1")
    inv.transition("m", S.CONFIGURING, 3, cluster="c1", assigned_need_fingerprint="fp", assigned_priority=50)
    m = inv.transition("m", S.CONFIGURED, 4, node_name="node-1", assigned_interruption_penalty_dollars=8.0)
    assert m.state_since_unix_nanos == 4 and m.assigned_priority == 50 and m.node_name == "node-1"
    assert [x.id for x in inv.by_cluster("c1")] == ["m"]
    assert [x.id for x in inv.by_cluster("c1", S.CONFIGURED)] == ["m"] and inv.by_cluster("c1", S.IDLE) == []
    inv.transition("m", S.DRAINING, 5)
    m = inv.transition("m", S.IDLE, 6, cluster="", assigned_priority=0, assigned_need_fingerprint="",
                       assigned_interruption_penalty_dollars=0.0)
    assert inv.by_cluster("c1") == [] and inv.clusters() == []
    assert m.assignment.is_empty
    inv.transition("m", S.DELETING, 7)
    m = inv.transition("m", S.SPECULATIVE, 8, host_provider="", host_ref="", node_name="")
    assert m.state is S.SPECULATIVE and inv.count(S.SPECULATIVE) == 1
    check_indexes(inv)


def test_failed_transition_changes_nothing() -> None:
    inv = Inventory([valid_machine("m", S.IDLE)])
    before = inv["m"]
    gen = inv.generation
    with pytest.raises(IllegalTransition):
        inv.transition("m", S.CONFIGURED, 9, cluster="c1")
    with pytest.raises(ValidationError):
        inv.transition("m", S.CONFIGURING, 9, host_provider="", host_ref="")  # would break the invariant
    with pytest.raises(UnknownMachine):
        inv.transition("nope", S.IDLE, 9)
    assert inv["m"] is before and inv.generation == gen
    check_indexes(inv)


def test_failed_is_terminal_in_the_inventory() -> None:
    inv = Inventory([valid_machine("m", S.CREATING)])
    inv.transition("m", S.FAILED, 1, last_error="quota")
    for s in S:
        with pytest.raises(IllegalTransition):
            inv.transition("m", s, 2, last_error="x")
    assert inv.remove("m") is not None  # only removal (out of band) gets rid of it


def test_upsert_keeps_stamp_on_same_state_and_stamps_entry() -> None:
    inv = Inventory()
    m = inv.upsert(valid_machine("m", S.IDLE), 100)
    assert m.state_since_unix_nanos == 100
    m = inv.upsert(valid_machine("m", S.IDLE, node_name="n"), 200)  # a merge
    assert m.state_since_unix_nanos == 100 and m.node_name == "n"
    m = inv.upsert(valid_machine("m", S.CONFIGURED), 300)  # provider jumped; reconcile accepts
    assert m.state_since_unix_nanos == 300 and inv.count(S.IDLE) == 0
    with pytest.raises(IllegalTransition):
        inv.apply(valid_machine("m", S.IDLE), 400)  # the shard's own writes are checked
    with pytest.raises(ValidationError):
        inv.upsert(valid_machine("m", S.CONFIGURED, cluster=""), 500)
    assert inv["m"].state is S.CONFIGURED
    gen = inv.generation
    assert inv.upsert(inv["m"], 600) is inv["m"] and inv.generation == gen  # no-op
    check_indexes(inv)


def test_update_is_a_merge_only() -> None:
    inv = Inventory([valid_machine("m", S.CONFIGURED)])
    m = inv.update("m", node_name="node-9")
    assert m.node_name == "node-9"
    with pytest.raises(ValueError):
        inv.update("m", state=S.DRAINING)
    with pytest.raises(ValidationError):
        inv.update("m", cluster="")
    with pytest.raises(UnknownMachine):
        inv.update("x", node_name="n")


def test_label_index() -> None:
    inv = Inventory(
        [
            valid_machine("a", S.IDLE, labels={"pool": "gpu"}),
            valid_machine("b", S.IDLE, labels={"pool": "gpu"}),
            valid_machine("c", S.IDLE, labels={"pool": "cpu"}, zone="eu-1b"),
            valid_machine("d", S.SPECULATIVE, labels={}),
        ]
    )
    assert sorted(m.id for m in inv.by_label("pool", "gpu")) == ["a", "b"]
    assert sorted(m.id for m in inv.by_label("pool")) == ["a", "b", "c"]
    assert sorted(m.id for m in inv.by_label(ZONE_LABEL, "eu-1a")) == ["a", "b", "d"]
    assert inv.by_label("nope") == []
    assert len(inv.label_sets()) == 3


def test_copy_is_independent() -> None:
    inv = Inventory([valid_machine("a", S.IDLE)])
    snap = inv.copy()
    inv.transition("a", S.CONFIGURING, 1, cluster="c")
    assert snap["a"].state is S.IDLE and inv["a"].state is S.CONFIGURING
    assert snap.by_cluster("c") == [] and len(inv.by_cluster("c")) == 1
    check_indexes(snap)
    check_indexes(inv)


def test_counts_and_ids() -> None:
    inv = Inventory([valid_machine(f"m{i}", s) for i, s in enumerate([S.IDLE, S.IDLE, S.CONFIGURED, S.FAILED])])
    counts = inv.counts()
    assert counts[S.IDLE] == 2 and counts[S.CONFIGURED] == 1 and counts[S.FAILED] == 1 and counts[S.DRAINING] == 0
    assert len(counts) == 8
    assert inv.ids() == ["m0", "m1", "m2", "m3"]
    assert inv.count_by_cluster_state() == {("c1", S.CONFIGURED): 1}
    assert pickle.loads(pickle.dumps(list(inv))) == list(inv)


@settings(deadline=None, max_examples=60)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "transition", "remove", "upsert"]),
            st.sampled_from(["m0", "m1", "m2", "m3"]),
            st.sampled_from([s for s in S if s is not S.UNSPECIFIED]),
            st.sampled_from(["c1", "c2"]),
        ),
        max_size=40,
    )
)
def test_random_operations_never_lose_or_duplicate(ops: list[tuple[str, str, MachineState, str]]) -> None:
    """Whatever sequence of (possibly illegal) writes arrives, the inventory matches a plain model."""
    inv = Inventory()
    model: dict[str, MachineState] = {}
    for now, (op, mid, state, cluster) in enumerate(ops):
        try:
            if op == "add":
                inv.add(valid_machine(mid, state, **({"cluster": cluster} if state in (S.CONFIGURED, S.DRAINING) else {})))
                assert mid not in model
                model[mid] = state
            elif op == "upsert":
                inv.upsert(valid_machine(mid, state), now)
                model[mid] = state
            elif op == "remove":
                assert (inv.remove(mid) is not None) == (mid in model)
                model.pop(mid, None)
            else:
                over: dict[str, object] = {}
                if state not in (S.SPECULATIVE, S.CREATING):
                    over.update(host_provider="p", host_ref="r")
                else:
                    over.update(host_provider="", host_ref="")
                over["cluster"] = cluster if state in (S.CONFIGURING, S.CONFIGURED, S.DRAINING) else ""
                if state is S.FAILED:
                    over["last_error"] = "e"
                inv.transition(mid, state, now, **over)
                assert mid in model and can_transition(model[mid], state)
                model[mid] = state
        except DuplicateMachine:
            assert mid in model
        except UnknownMachine:
            assert mid not in model
        except IllegalTransition:
            assert mid in model and not can_transition(model[mid], state)
        assert {m.id: m.state for m in inv} == model
        check_indexes(inv)


def test_every_write_moves_the_record_to_the_end() -> None:
    """Contract used by the decision engine's incremental index: changed records form the tail."""
    inv = Inventory([valid_machine(f"m{i}", S.IDLE) for i in range(4)])
    inv.transition("m1", S.CONFIGURING, 1, cluster="c")
    assert [m.id for m in inv.machines()] == ["m0", "m2", "m3", "m1"]
    inv.update("m0", node_name="n0")
    inv.upsert(valid_machine("m2", S.IDLE, node_name="n2"), 2)
    assert [m.id for m in inv.machines()] == ["m3", "m1", "m0", "m2"]
    inv.upsert(inv["m3"], 3)  # no-op: stays put, generation unchanged
    assert [m.id for m in inv.machines()] == ["m3", "m1", "m0", "m2"]
    inv.add(valid_machine("m9", S.IDLE))
    assert [m.id for m in inv.machines()][-1] == "m9"


def test_shape_groups_know_when_they_are_in_id_order() -> None:
    """A bulk load in id order leaves every (state, shape) group id-ordered (the engine's cold index
    build then skips a sort); a write that lands out of order clears it for that group only, until
    the group empties; copies keep it."""
    inv = Inventory([valid_machine(f"m{i}", S.IDLE) for i in range(5)] +
                    [valid_machine(f"c{i}", S.CONFIGURED, cluster="c1") for i in range(3)])

    def ordered(state: MachineState) -> list[bool]:
        return [g.id_ordered for _, g in inv.by_state(state).by_shape()]

    assert ordered(S.IDLE) == [True] and ordered(S.CONFIGURED) == [True]
    inv.update("m4", node_name="n")  # re-inserted at the end, still the largest id: stays ordered
    assert ordered(S.IDLE) == [True]
    inv.update("m1", node_name="n")  # m1 now after m4
    assert ordered(S.IDLE) == [False] and ordered(S.CONFIGURED) == [True]
    assert inv.copy().by_state(S.IDLE).by_shape()[0][1].id_ordered is False
    for i in range(5):
        inv.remove(f"m{i}")
    inv.add(valid_machine("m9", S.IDLE))
    assert ordered(S.IDLE) == [True]
    check_indexes(inv)


def test_shape_groups_count_their_penalty_stamps() -> None:
    """Each (state, shape) group knows its distinct reclamation penalty stamps (every NaN as one), so the
    engine's cold index build knows a group's penalty order without reading its records."""
    nan = float("nan")
    inv = Inventory([valid_machine(f"m{i}", S.IDLE, assigned_reclamation_penalty_dollars=p)
                     for i, p in enumerate((0.0, 3.0, 3.0, nan, float("nan")))])

    def pens() -> list[float]:
        (_, group), = inv.by_state(S.IDLE).by_shape()
        return sorted(group.reclamation_penalties, key=lambda p: (p == p, p))

    got = pens()
    assert len(got) == 3 and got[0] != got[0] and got[1:] == [0.0, 3.0]
    inv.remove("m3")
    assert len(pens()) == 3  # one NaN left
    inv.remove("m4")
    inv.update("m1", assigned_reclamation_penalty_dollars=0.0)
    assert pens() == [0.0, 3.0]
    inv.remove("m2")
    assert pens() == [0.0]
    assert inv.copy().by_state(S.IDLE).by_shape()[0][1].reclamation_penalties == {0.0: 0}.keys()


# --- the write journal (`replaced_since`) -----------------------------------------------------------


def test_journal_lists_what_each_write_replaced_in_the_tables_tail_order() -> None:
    inv = Inventory([valid_machine(f"m{i}", S.IDLE) for i in range(5)])
    assert inv.replaced_since(inv.generation) is None  # nobody asked before: nothing journaled
    g0 = inv.generation
    before = {m.id: m for m in inv}
    inv.transition("m3", S.CONFIGURING, 5, cluster="c1")
    inv.add(valid_machine("m9", S.IDLE))
    inv.upsert(before["m1"].replace(labels={"pool": "gpu"}))
    inv.upsert(before["m0"])  # a no-op write: not a change, not journaled
    inv.update("m4", labels={"pool": "x"})
    olds = inv.replaced_since(g0)
    assert olds is not None and len(olds) == inv.generation - g0 == 4
    written = list(inv.machines())[-4:]
    assert [m.id for m in written] == ["m3", "m9", "m1", "m4"]
    assert [o if o is None else o.id for o in olds] == ["m3", None, "m1", "m4"]
    assert all(o is None or o is before[o.id] for o in olds)
    assert inv.replaced_since(inv.generation) == []  # a fresh journal starts at each call


@pytest.mark.parametrize("spoil", ["remove", "twice", "generation", "cap"])
def test_journal_is_unknown_when_the_tail_would_not_tell(spoil: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import bigfleet.machine.inventory as inventory_mod

    inv = Inventory([valid_machine(f"m{i}", S.IDLE) for i in range(4)])
    inv.replaced_since(-1)
    g0 = inv.generation
    inv.update("m0", labels={"pool": "a"})
    if spoil == "remove":
        inv.remove("m2")
    elif spoil == "twice":
        inv.update("m0", labels={"pool": "b"})
    elif spoil == "cap":
        monkeypatch.setattr(inventory_mod, "_JOURNAL_CAP", 2)
        inv.update("m1", labels={"pool": "a"})
        inv.update("m3", labels={"pool": "a"})
    got = inv.replaced_since(g0 - 1 if spoil == "generation" else g0)
    assert got is None
    g1 = inv.generation
    inv.update("m1", labels={"pool": "z"})  # the next journal is whole again
    got = inv.replaced_since(g1)
    assert got is not None and [o.id for o in got if o is not None] == ["m1"]


def test_a_failed_write_is_not_journaled() -> None:
    inv = Inventory([valid_machine("m0", S.IDLE)])
    g0 = inv.generation
    inv.replaced_since(g0)
    with pytest.raises(IllegalTransition):
        inv.transition("m0", S.DRAINING, 5)
    assert inv.generation == g0 and inv.replaced_since(g0) == []
