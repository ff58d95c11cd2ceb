"""The pure contract core, driven deterministically (no wire, no clock)."""

from __future__ import annotations

import math
import random

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigfleet.provider.fake.catalog import build_catalog
from bigfleet.provider.kit.core import ProviderCore, parse_revision
from bigfleet.provider.kit.model import (
    CapacityType,
    Fence,
    HostRef,
    Instance,
    InvalidRecord,
    Kind,
    KitError,
    State,
)

Z = Fence()


def core_with(n: int = 4) -> ProviderCore:
    c = ProviderCore()
    c.seed(build_catalog(n))
    return c


def code_of(fn, *a, **kw) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(KitError) as ei:
        fn(*a, **kw)
    return ei.value.code


def test_full_lifecycle_and_binding() -> None:
    c = core_with()
    mid = "aws-00000"
    ack = c.mutate(Kind.CREATE, mid, Z)
    assert ack.started and ack.machine.state == State.CREATING and ack.operation_id == "op-1"
    assert c.complete(mid, Kind.CREATE, ack.operation_id, host=HostRef("p", "h1"))
    assert c.get(mid).state == State.IDLE and c.get(mid).host.ref == "h1"
    ack = c.mutate(Kind.CONFIGURE, mid, Z, "c1", {"k": "v"})
    assert ack.machine.state == State.CONFIGURING and ack.machine.cluster == "c1"
    assert ack.machine.shard_metadata == {"k": "v"}
    c.complete(mid, Kind.CONFIGURE, ack.operation_id)
    assert c.get(mid).state == State.CONFIGURED
    ack = c.mutate(Kind.DRAIN, mid, Z)
    assert ack.machine.cluster == "c1"  # binding visible while draining
    c.complete(mid, Kind.DRAIN, ack.operation_id)
    rec = c.get(mid)
    assert rec.state == State.IDLE and rec.cluster == "" and rec.shard_metadata == {}
    ack = c.mutate(Kind.DELETE, mid, Z)
    c.complete(mid, Kind.DELETE, ack.operation_id)
    rec = c.get(mid)
    assert rec.state == State.SPECULATIVE and rec.host.empty


def test_illegal_transitions_are_rejected_without_change_and_never_fp() -> None:
    c = core_with()
    mid = "aws-00000"
    before = c.get(mid).copy()
    rev = c.rev
    for kind in (Kind.CONFIGURE, Kind.DRAIN, Kind.DELETE):
        code = code_of(c.mutate, kind, mid, Z, "c1")
        assert code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OK)
    assert c.get(mid) == before and c.rev == rev


def test_failed_is_terminal_and_last_error_kept() -> None:
    c = core_with()
    mid = "aws-00000"
    ack = c.mutate(Kind.CREATE, mid, Z)
    c.complete(mid, Kind.CREATE, ack.operation_id, error="boom")
    assert c.get(mid).state == State.FAILED and c.get(mid).last_error == "boom"
    for kind in Kind:
        assert code_of(c.mutate, kind, mid, Fence("s", 1, 10 + list(Kind).index(kind)), "c") == grpc.StatusCode.INTERNAL
    assert c.get(mid).last_error == "boom"


def test_fencing_rules() -> None:
    c = core_with()
    mid, other = "aws-00000", "aws-00001"
    c.mutate(Kind.CREATE, mid, Fence("s", 5, 5))
    # equal and older tokens are fenced, before the idempotency shortcut
    assert code_of(c.mutate, Kind.CREATE, mid, Fence("s", 5, 5)) == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(c.mutate, Kind.CREATE, mid, Fence("s", 4, 99)) == grpc.StatusCode.FAILED_PRECONDITION
    # newer seq and a higher epoch with a low seq pass (idempotent hit)
    assert c.mutate(Kind.CREATE, mid, Fence("s", 5, 6)).operation_id == "op-1"
    assert c.mutate(Kind.CREATE, mid, Fence("s", 6, 1)).operation_id == "op-1"
    # per machine: a lower token on another machine is first contact
    c.mutate(Kind.CREATE, other, Fence("s", 1, 1))
    # per shard: another shard id has its own mark
    c.mutate(Kind.CREATE, mid, Fence("t", 0, 0))
    # a fresh token on a ghost: NOT_FOUND and the mark still advances
    assert code_of(c.mutate, Kind.CREATE, "ghost", Fence("s", 1, 1)) == grpc.StatusCode.NOT_FOUND
    assert code_of(c.mutate, Kind.CREATE, "ghost", Fence("s", 1, 1)) == grpc.StatusCode.FAILED_PRECONDITION
    # int64 extremes compare without overflow
    big = (1 << 63) - 1
    c.mutate(Kind.CREATE, mid, Fence("u", big, big - 1))
    c.mutate(Kind.CREATE, mid, Fence("u", big, big))
    assert code_of(c.mutate, Kind.CREATE, mid, Fence("u", big, big)) == grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(c.mutate, Kind.CREATE, mid, Fence("u", big, 1 << 63)) == grpc.StatusCode.INVALID_ARGUMENT


def test_fence_advances_even_when_the_call_is_rejected() -> None:
    c = core_with()
    mid = "aws-00000"
    before = c.changes
    assert code_of(c.mutate, Kind.DRAIN, mid, Fence("s", 1, 3)) == grpc.StatusCode.INTERNAL
    assert c.changes > before  # must be persisted
    assert code_of(c.mutate, Kind.CREATE, mid, Fence("s", 1, 2)) == grpc.StatusCode.FAILED_PRECONDITION


def test_idempotency_same_op_id_distinct_across_cycles() -> None:
    c = core_with()
    mid = "aws-00000"
    a1 = c.mutate(Kind.CREATE, mid, Z)
    a2 = c.mutate(Kind.CREATE, mid, Z)
    assert a1.operation_id == a2.operation_id and not a2.started
    c.complete(mid, Kind.CREATE, a1.operation_id, host=HostRef("p", "h"))
    a3 = c.mutate(Kind.CREATE, mid, Z)
    assert a3.operation_id == a1.operation_id and a3.machine.state == State.IDLE
    cfg1 = c.mutate(Kind.CONFIGURE, mid, Z, "c1")
    c.complete(mid, Kind.CONFIGURE, cfg1.operation_id)
    again = c.mutate(Kind.CONFIGURE, mid, Z, "c1")
    assert again.operation_id == cfg1.operation_id and again.machine.state == State.CONFIGURED
    assert code_of(c.mutate, Kind.CONFIGURE, mid, Z, "c2") == grpc.StatusCode.ALREADY_EXISTS
    d = c.mutate(Kind.DRAIN, mid, Z)
    c.complete(mid, Kind.DRAIN, d.operation_id)
    cfg2 = c.mutate(Kind.CONFIGURE, mid, Z, "c2")
    assert cfg2.operation_id not in (cfg1.operation_id, d.operation_id, a1.operation_id)


def test_stale_completion_is_dropped() -> None:
    c = core_with()
    mid = "aws-00000"
    ack = c.mutate(Kind.CREATE, mid, Z)
    assert not c.complete(mid, Kind.CREATE, "op-999", host=HostRef("p", "h"))
    assert c.complete(mid, Kind.CREATE, ack.operation_id, error="timed out")
    assert not c.complete(mid, Kind.CREATE, ack.operation_id, host=HostRef("p", "h"))  # late success
    assert c.get(mid).state == State.FAILED


def test_create_without_host_fails() -> None:
    c = core_with()
    ack = c.mutate(Kind.CREATE, "aws-00000", Z)
    c.complete("aws-00000", Kind.CREATE, ack.operation_id, host=HostRef())
    assert c.get("aws-00000").state == State.FAILED


def test_metadata_is_copied_not_aliased() -> None:
    c = core_with()
    ack = c.mutate(Kind.CREATE, "aws-00000", Z)
    c.complete("aws-00000", Kind.CREATE, ack.operation_id, host=HostRef("p", "h"))
    md = {"a\x00b": "\x00\x85é"}
    c.mutate(Kind.CONFIGURE, "aws-00000", Z, "c", md)
    md["x"] = "y"
    assert c.get("aws-00000").shard_metadata == {"a\x00b": "\x00\x85é"}


def test_list_filters_cap_and_order_varies() -> None:
    c = core_with(40)
    rng = random.Random(1)
    got, rev = c.list([], 0, b"", rng)
    assert len(got) == 40 and rev == 40
    assert len(c.list([State.SPECULATIVE], 5, b"", rng)[0]) == 5
    firsts = {c.list([State.SPECULATIVE], 1, b"", rng)[0][0].id for _ in range(20)}
    assert len(firsts) > 3
    assert c.list([State.IDLE], 0, b"", rng)[0] == []
    assert code_of(c.list, [99], 0, b"", rng) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(c.list, [], -1, b"", rng) == grpc.StatusCode.INVALID_ARGUMENT


def test_since_revision_deltas() -> None:
    c = core_with(10)
    rng = random.Random(2)
    _, r0 = c.list([], 0, b"", rng)
    assert c.list([], 0, str(r0).encode(), rng)[0] == []
    ack = c.mutate(Kind.CREATE, "aws-00000", Z)
    delta, r1 = c.list([], 0, str(r0).encode(), rng)
    assert [m.id for m in delta] == ["aws-00000"] and r1 > r0
    c.complete("aws-00000", Kind.CREATE, ack.operation_id, host=HostRef("p", "h"))
    assert [m.id for m in c.list([], 0, str(r1).encode(), rng)[0]] == ["aws-00000"]
    for garbage in (b"", b"\x00\xff", b" 1", b"1_0", b"0x10", b"99999999999999999999999", "١".encode()):
        assert len(c.list([], 0, garbage, rng)[0]) == 10
    # a cursor this core never issued (ahead of its revision: a provider that restarted without its
    # state hands out low revisions again) is unknown, so the answer is the full list, not nothing
    rev_now = c.list([], 0, b"", rng)[1]
    for ahead in (str(rev_now + 1).encode(), b"1000000000000", b"9223372036854775807"):
        assert len(c.list([], 0, ahead, rng)[0]) == 10, ahead


@given(st.binary(max_size=24))
def test_parse_revision_never_raises(b: bytes) -> None:
    v = parse_revision(b)
    if v is not None:
        assert v == int(b.decode("ascii")) and b.strip() == b and b"_" not in b


def test_snapshot_restore_and_recovery() -> None:
    c = core_with(6)
    c.mutate(Kind.CREATE, "aws-00000", Fence("s", 1, 1))
    c.mutate(Kind.CREATE, "aws-00001", Z)
    c.complete("aws-00001", Kind.CREATE, "op-2", host=HostRef("p", "h"))
    snap = c.snapshot()
    d = ProviderCore()
    d.restore(snap)
    assert d.rev == c.rev and d.next_op == c.next_op and d.fences == c.fences and d.ops == c.ops
    assert d.recover_interrupted() == ["aws-00000"]
    rec = d.get("aws-00000")
    assert rec.state == State.FAILED and "interrupted" in rec.last_error
    assert d.rev == c.rev + 1
    assert code_of(d.mutate, Kind.CREATE, "aws-00000", Fence("s", 1, 1)) == grpc.StatusCode.FAILED_PRECONDITION
    assert d.mutate(Kind.CONFIGURE, "aws-00001", Z, "c").operation_id == "op-3"


@pytest.mark.parametrize(
    "bad",
    [
        dict(id=""),
        dict(instance_type=""),
        dict(capacity_type=CapacityType.UNSPECIFIED),
        dict(price_per_hour=math.nan),
        dict(price_per_hour=math.inf),
        dict(price_per_hour=-1.0),
        dict(interruption_probability=1.5),
        dict(interruption_probability=math.nan),
        dict(capacity_type=CapacityType.SPOT, interruption_probability=0.0),
        dict(labels={"zone": "a"}),
        dict(resources={"cpu": "lots"}),
        dict(host=HostRef("p", "h"), state=State.SPECULATIVE),
        dict(state=State.IDLE),
        dict(state=State.CONFIGURED),
    ],
)
def test_invalid_backend_records_are_refused(bad: dict[str, object]) -> None:
    base = dict(id="m", instance_type="t", zone="z", capacity_type=CapacityType.ON_DEMAND, price_per_hour=1.0)
    base.update(bad)
    c = ProviderCore()
    with pytest.raises(InvalidRecord):
        c.seed([Instance(**base)])  # type: ignore[arg-type]
    assert c.is_fresh


def test_duplicate_ids_refused() -> None:
    inst = build_catalog(1)[0]
    with pytest.raises(InvalidRecord):
        ProviderCore().seed([inst, inst])


def test_reconcile_refreshes_cost_only() -> None:
    c = core_with(3)
    insts = build_catalog(3)
    insts[0].price_per_hour = 9.0
    insts[0].zone = "elsewhere"
    insts.append(Instance("new-1", "t", "z", CapacityType.ON_DEMAND, 1.0))
    insts.append(Instance("bad", "t", "z", CapacityType.ON_DEMAND, math.nan))
    rev = c.rev
    changed, skipped = c.reconcile(insts)
    assert changed == 2 and len(skipped) == 1 and c.rev == rev + 2
    assert c.get(insts[0].id).price_per_hour == 9.0 and c.get(insts[0].id).zone != "elsewhere"
    assert c.reconcile(insts) == (0, skipped)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(list(Kind)), st.integers(0, 2), st.booleans(), st.booleans()), max_size=40))
def test_random_call_sequences_keep_invariants(calls: list[tuple[Kind, int, bool, bool]]) -> None:
    """Whatever order calls and completions arrive in, states and bindings stay consistent."""
    c = core_with(3)
    ids = [m.id for m in c.machines.values()]
    last_rev = c.rev
    for kind, i, finish, fail in calls:
        try:
            ack = c.mutate(kind, ids[i], Z, "cl")
        except KitError as exc:
            assert exc.code != grpc.StatusCode.FAILED_PRECONDITION
            continue
        if finish:
            c.complete(ids[i], kind, ack.operation_id, "x" if fail else None, host=HostRef("p", "h"))
        assert c.rev >= last_rev
        last_rev = c.rev
        for rec in c.machines.values():
            if rec.state in (State.SPECULATIVE, State.CREATING):
                assert rec.host.empty or rec.state == State.CREATING
            if rec.state in (State.CONFIGURING, State.CONFIGURED, State.DRAINING):
                assert rec.cluster == "cl"
            if rec.state in (State.SPECULATIVE, State.IDLE):
                assert rec.cluster == "" and rec.shard_metadata == {}
            if rec.state == State.FAILED:
                assert rec.last_error


@settings(max_examples=80, deadline=None)
@given(
    st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=4),
    st.sampled_from(list(State)),
    st.text(max_size=8),
    st.text(max_size=8),
    st.booleans(),
)
def test_hand_encoded_wire_matches_protobuf(md: dict[str, str], state: State, cluster: str, err: str,
                                            host: bool) -> None:
    from bigfleet.v1alpha1 import provider_pb2 as pb

    c = core_with(2)
    rec = c.get("aws-00000")
    rec.state, rec.cluster, rec.last_error, rec.shard_metadata = state, cluster, err, md
    rec.host = HostRef("p", "h") if host else HostRef()
    rec.touch(c.rev + 1)
    assert pb.Machine.FromString(rec.wire()) == rec.to_proto()
    snap = rec.copy()
    assert snap.wire() == rec.wire()



def test_only_the_latest_transition_is_replayable() -> None:
    """A Drain from an earlier life of the slot (before a Delete and a new Create) is not a repeat:
    a fresh Drain on the new IDLE machine is an invalid transition, and that survives a restore."""
    c = core_with()
    mid = "aws-00000"
    steps = ((Kind.CREATE, ()), (Kind.CONFIGURE, ("c1", {})), (Kind.DRAIN, ()), (Kind.DELETE, ()), (Kind.CREATE, ()))
    for kind, extra in steps:
        ack = c.mutate(kind, mid, Z, *extra)
        c.complete(mid, kind, ack.operation_id, host=HostRef("p", "h1") if kind == Kind.CREATE else None)
    assert c.get(mid).state == State.IDLE
    assert code_of(c.mutate, Kind.DRAIN, mid, Z) == grpc.StatusCode.INTERNAL
    d = ProviderCore()
    d.restore(c.snapshot())
    assert code_of(d.mutate, Kind.DRAIN, mid, Z) == grpc.StatusCode.INTERNAL
    # ...while a true repeat of the latest transition is still a replay with the same id
    again = d.mutate(Kind.CREATE, mid, Z)
    assert not again.started
