"""Incremental List reads a change-order index; it must answer exactly what a full scan answers."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from bigfleet.provider.fake.catalog import build_catalog
from bigfleet.provider.kit.core import ProviderCore
from bigfleet.provider.kit.model import Fence, HostRef, Kind, KitError, State

Z = Fence()
NEXT = {State.SPECULATIVE: Kind.CREATE, State.IDLE: Kind.CONFIGURE, State.CONFIGURED: Kind.DRAIN}


def _scan(core: ProviderCore, since: bytes, states: list[int]) -> set[str]:
    saved = core._indexed_rev
    core._indexed_rev = -1  # distrust the index: the reference answer is a scan of every record
    try:
        recs, _ = core.list(states, 0, since, random.Random(0))
    finally:
        core._indexed_rev = saved
    return {r.id for r in recs}


def _indexed(core: ProviderCore, since: bytes, states: list[int]) -> set[str]:
    recs, _ = core.list(states, 0, since, random.Random(0))
    ids = [r.id for r in recs]
    assert len(ids) == len(set(ids)), "duplicate ids in a List"
    return set(ids)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 11), st.booleans(), st.booleans()), min_size=1, max_size=60),
       st.integers(0, 5))
def test_incremental_list_matches_a_full_scan(steps: list[tuple[int, bool, bool]], restore_at: int) -> None:
    core = ProviderCore()
    core.seed(build_catalog(12))
    ids = sorted(core.machines)
    cursors = [b"", b"0", str(core.rev).encode()]
    pending: dict[str, tuple[Kind, str]] = {}
    for i, (k, finish, fail) in enumerate(steps):
        mid = ids[k]
        if mid in pending and finish:
            kind, op = pending.pop(mid)
            core.complete(mid, kind, op, "boom" if fail else None, host=HostRef("p", f"h-{mid}"))
        elif mid not in pending and (nxt := NEXT.get(core.machines[mid].state)) is not None:
            try:
                ack = core.mutate(nxt, mid, Z, "c1" if nxt == Kind.CONFIGURE else "", {})
            except KitError:
                continue
            pending[mid] = (nxt, ack.operation_id)
        if i == restore_at:  # a reload rebuilds the index from the snapshot
            snap = core.snapshot()
            core = ProviderCore()
            core.restore(snap)
        cursors.append(str(core.rev).encode())
        for since in (cursors[len(cursors) // 2], cursors[-2], b"-5", b"999999"):
            for states in ([], [int(State.IDLE), int(State.CONFIGURED)]):
                assert _indexed(core, since, states) == _scan(core, since, states)


def test_a_delta_list_reads_only_what_changed() -> None:
    core = ProviderCore()
    core.seed(build_catalog(2000))
    before = str(core.rev).encode()
    ack = core.mutate(Kind.CREATE, "aws-00000", Z)
    recs, rev = core.list([], 0, before, random.Random(0))
    assert [r.id for r in recs] == ["aws-00000"] and rev == core.rev
    assert core.complete("aws-00000", Kind.CREATE, ack.operation_id, host=HostRef("p", "h"))
    recs, _ = core.list([], 0, str(rev).encode(), random.Random(0))
    assert [(r.id, r.state) for r in recs] == [("aws-00000", State.IDLE)]
    assert core.list([], 0, str(core.rev).encode(), random.Random(0))[0] == []
