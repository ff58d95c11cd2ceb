"""The topology test's invariant checker flags what it is meant to flag (no processes: fast)."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from bigfleet.v1alpha1 import coordinator_pb2, shard_pb2

from .fleet import Call, Frame, RoutedOperator, violations

pytestmark = pytest.mark.topology


def call(rpc: str, mid: str, shard: str, t: float, cluster: str = "", code: grpc.StatusCode = grpc.StatusCode.OK,
         answered: float | None = None) -> Call:
    return Call(rpc, mid, shard, 1, cluster, t, 1_000_000.0 + t, t + 0.01 if answered is None else answered, code)


def operator(cluster: str, reclaim_at: dict[str, float]) -> RoutedOperator:
    op = RoutedOperator(["127.0.0.1:1"], cluster)
    for node, at in reclaim_at.items():
        op.frames.append(Frame(at, "shard", shard_pb2.ShardMessage(
            reclaim_instruction=shard_pb2.ReclaimInstruction(instruction_id="i", nodes=[node]))))
    return op


def transfer(frm: str, to: str, ids: list[str], created: float, phase: str = "done") -> coordinator_pb2.TransferStatus:
    return coordinator_pb2.TransferStatus(kind="drain", from_shard_id=frm, to_shard_id=to, phase=phase,
                                          machine_ids=ids, created_at_unix_ns=int((1_000_000.0 + created) * 1e9))


def check(calls: list[Call], ops: list[RoutedOperator],
          transfers: list[coordinator_pb2.TransferStatus] | None = None) -> list[str]:
    return violations(SimpleNamespace(calls=calls), ops, transfers or [])  # type: ignore[arg-type]


def test_drain_after_the_reclaim_passes_and_before_it_fails() -> None:
    calls = [call("Configure", "m1", "s0", 1.0, "c"), call("Drain", "m1", "s0", 3.0)]
    assert check(calls, [operator("c", {"m1": 2.0})]) == []
    assert check(calls, [operator("c", {"m1": 3.5})])  # told only after the drain
    assert check(calls, [operator("c", {"m1": 0.5})])  # told before this binding began
    assert check(calls, [operator("c", {"other": 2.0})])  # told about another node
    assert check(calls, [operator("d", {"m1": 2.0})])  # another cluster's operator was told


def test_shard_changes_need_a_transfer_and_must_not_overlap() -> None:
    ops = [operator("c", {"m1": 2.0}), operator("h", {})]
    calls = [call("Configure", "m1", "s0", 1.0, "c"), call("Drain", "m1", "s0", 3.0),
             call("Configure", "m1", "s1", 6.0, "h")]
    assert len(check(calls, ops)) == 1  # no transfer at all
    assert check(calls, ops, [transfer("s0", "s1", ["m1"], 2.5)]) == []
    assert check(calls, ops, [transfer("s0", "s1", ["m1"], 2.5, phase="aborted")])
    assert check(calls, ops, [transfer("s1", "s0", ["m1"], 2.5)])  # the wrong way
    assert check(calls, ops, [transfer("s0", "s1", ["m2"], 2.5)])  # another machine
    assert check(calls, ops, [transfer("s0", "s1", ["m1"], 9.0)])  # created after s1 acted
    back = [*calls, call("Drain", "m1", "s0", 8.0)]  # s0 acts again: needs a transfer back
    assert check(back, ops, [transfer("s0", "s1", ["m1"], 2.5)])
    overlap = [call("Configure", "m1", "s0", 1.0, "c", answered=7.0), call("Configure", "m1", "s1", 6.0, "h")]
    assert check(overlap, ops, [transfer("s0", "s1", ["m1"], 0.5)])
    refused = [call("Configure", "m1", "s0", 1.0, "c"),
               call("Configure", "m1", "s1", 6.0, "h", code=grpc.StatusCode.FAILED_PRECONDITION)]
    assert check(refused, ops) == []  # only calls the provider accepted count
