"""Session server on a real grpc.aio server: Hello rules, acks, replacement, roll-up validation,
bootstrap correlation and timeout, explicit shutdown status."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import CollectorRegistry

from bigfleet.needs import NeedsTable, ValidationError
from bigfleet.rpc import insecure_channel, new_server
from bigfleet.security import SHARD_POLICY, RoleInterceptor
from bigfleet.security.limits import SESSION_STREAM_LIMIT
from bigfleet.shard.sessions import (
    BootstrapUnavailable,
    OperatorSession,
    RollupOutcome,
    SessionRegistry,
    SessionServicer,
)
from bigfleet.v1alpha1 import capacity_pb2, shard_pb2, shard_pb2_grpc
from bigfleet.wire.needs import rollup_from_proto

from .opsim import FakeOperator, need


async def until(pred: object, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class Harness:
    target: str
    registry: SessionRegistry
    servicer: SessionServicer
    table: NeedsTable
    server: grpc.aio.Server


@pytest.fixture(params=[False])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """The session server alone; with the param True, behind the shard's role gate and stream limits."""
    table = NeedsTable()
    registry = SessionRegistry()

    async def on_rollup(cluster_id: str, pb: capacity_pb2.ClusterCapacityNeeds) -> RollupOutcome:
        try:
            _, needs = rollup_from_proto(pb, time.time_ns())
        except ValidationError as exc:
            return RollupOutcome(False, error=str(exc))
        table.replace(cluster_id, needs, time.time_ns())
        return RollupOutcome(True)

    servicer = SessionServicer(registry, on_rollup, lambda: (7, 3), lambda s: None)
    limits = {"/bigfleet.v1alpha1.Shard/Session": SESSION_STREAM_LIMIT}
    gate = RoleInterceptor(SHARD_POLICY, registry=CollectorRegistry(), component="shard", stream_limits=limits)
    server, _ = new_server(interceptors=[gate] if request.param else [])
    shard_pb2_grpc.add_ShardServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Harness(f"127.0.0.1:{port}", registry, servicer, table, server)
    finally:
        await server.stop(None)


async def _raw_session(target: str, first: shard_pb2.OperatorMessage) -> grpc.aio.AioRpcError:
    async with insecure_channel(target) as ch:
        call = shard_pb2_grpc.ShardStub(ch).Session()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call.write(first)
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    pytest.fail("stream ended without a status")
        return ei.value


async def test_first_frame_must_be_hello_with_cluster(harness: Harness) -> None:
    err = await _raw_session(harness.target, shard_pb2.OperatorMessage(
        rollup=capacity_pb2.ClusterCapacityNeeds(cluster_id="c1")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    err = await _raw_session(harness.target, shard_pb2.OperatorMessage(hello=shard_pb2.Hello(cluster_id="")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(harness.registry) == 0


async def test_a_hello_that_could_never_serve_is_refused_at_hello(harness: Harness) -> None:
    """A cluster id every roll-up would be rejected for, or another wire contract, ends the stream at
    once instead of installing a session that can never change demand."""
    for cid in ("bad cluster", "bad\x01c", "x" * 254):
        err = await _raw_session(harness.target, shard_pb2.OperatorMessage(hello=shard_pb2.Hello(cluster_id=cid)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "hello.cluster_id" in (err.details() or ""), cid
    err = await _raw_session(harness.target, shard_pb2.OperatorMessage(
        hello=shard_pb2.Hello(cluster_id="c1", protocol_version="v9")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "v1alpha1" in (err.details() or "")
    assert len(harness.registry) == 0


@pytest.mark.parametrize("harness", [True], indirect=True)
async def test_stream_guard_statuses_reach_the_operator(harness: Harness) -> None:
    """Behind the production gate: an over-long Hello id is RESOURCE_EXHAUSTED naming the field (as
    docs/security.md says), and a session the guard ends records the guard's reason, not "operator
    ended the stream"."""
    err = await _raw_session(harness.target, shard_pb2.OperatorMessage(hello=shard_pb2.Hello(cluster_id="c" * 100_000)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "hello.cluster_id" in (err.details() or "")
    async with FakeOperator(harness.target, "c1", blob=b"x" * (1024 * 1024 + 1)) as op:
        await until(lambda: harness.registry.get("c1") is not None)
        s = harness.registry.get("c1")
        assert s is not None
        with pytest.raises(BootstrapUnavailable):
            await s.request_bootstrap([], timeout=5)
        await until(lambda: s.closed.is_set(), what="session closed by the guard")
        assert s.close_code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "user_data" in s.close_reason
        del op


async def test_hello_ack_rollup_ack_and_validation_all_or_nothing(harness: Harness) -> None:
    async with FakeOperator(harness.target, "c1") as op:
        await until(lambda: op.acks("hello"), what="hello ack")
        ack = op.acks("hello")[0]
        assert (ack.coordinator_term, ack.shard_epoch) == (7, 3)
        await op.send_rollup([need("1", count=2), need("2", priority=5)])
        await until(lambda: op.acks("rollup"), what="rollup ack")
        assert len(harness.table.cluster("c1")) == 2
        before = harness.table.cluster("c1")
        bad = need("1")
        bad.aggregate_resources["cpu"] = "lots"
        await op.send_rollup([need("4"), bad])
        await until(lambda: op.acks("rollup-rejected:"), what="rejection on the stream")
        assert "aggregate_resources" in op.acks("rollup-rejected:")[0].echo or "cpu" in op.acks("rollup-rejected:")[0].echo
        assert harness.table.cluster("c1") == before
        assert len(op.acks("rollup")) == 1
        # a roll-up naming another cluster is refused on this stream
        await op.send_rollup([need("1")], cluster_id="someone-else")
        await until(lambda: len(op.acks("rollup-rejected:")) == 2, what="foreign roll-up rejected")
        assert harness.table.cluster("someone-else") == ()
        # a mid-stream Hello is answered, not fatal; one naming another cluster does not move the session
        await op.send(shard_pb2.OperatorMessage(hello=shard_pb2.Hello(cluster_id="c1")))
        await until(lambda: len(op.acks("hello")) == 2, what="second hello ack")
        await op.send(shard_pb2.OperatorMessage(hello=shard_pb2.Hello(cluster_id="c2")))
        await until(lambda: op.acks("hello-rejected:"), what="mid-stream hello for another cluster answered")
        assert "'c1'" in op.acks("hello-rejected:")[0].echo and harness.registry.get("c2") is None


async def test_newer_session_replaces_older(harness: Harness) -> None:
    async with FakeOperator(harness.target, "c1") as old:
        await until(lambda: old.acks("hello"))
        first = harness.registry.get("c1")
        async with FakeOperator(harness.target, "c1") as new:
            await until(lambda: new.acks("hello"))
            await until(lambda: old.status is not None, what="old session closed")
            assert old.status == grpc.StatusCode.ABORTED
            assert harness.registry.get("c1") is not first
            assert len(harness.registry) == 1
            await new.send_rollup([need("1")])
            await until(lambda: new.acks("rollup"))


async def test_bootstrap_pull_is_correlated_and_times_out(harness: Harness) -> None:
    async with FakeOperator(harness.target, "c1", blob=b"join-me") as op:
        await until(lambda: harness.registry.get("c1") is not None)
        s = harness.registry.get("c1")
        assert s is not None
        res = await s.request_bootstrap([], timeout=5)
        assert res.user_data == b"join-me" and res.error == ""
        req = op.of("bootstrap_request")[0].bootstrap_request
        assert req.cluster_id == "c1" and len(req.request_id) == 16
        # an unknown request id is dropped silently
        await op.send(shard_pb2.OperatorMessage(bootstrap_response=shard_pb2.BootstrapBlobResponse(request_id="nope")))
        op.answer_bootstrap = False
        with pytest.raises(BootstrapUnavailable):
            await s.request_bootstrap([], timeout=0.3)


async def test_reclaim_ack_resolves_and_shutdown_is_explicit(harness: Harness) -> None:
    async with FakeOperator(harness.target, "c1") as op:
        await until(lambda: harness.registry.get("c1") is not None)
        s = harness.registry.get("c1")
        assert s is not None
        fut = s.send_reclaim(["node-a", "node-b"], 30, 0)
        assert await asyncio.wait_for(fut, 5) == 2
        ri = op.reclaims()[0]
        assert list(ri.nodes) == ["node-a", "node-b"] and ri.grace_period_seconds == 30
        harness.servicer.shutting_down = True
        harness.registry.close_all(grpc.StatusCode.UNAVAILABLE, "shard shutting down; reconnect")
        await until(lambda: op.status is not None, what="stream end")
        assert op.status == grpc.StatusCode.UNAVAILABLE
        assert "reconnect" in op.details
    # new sessions are refused while shutting down
    err = await _raw_session(harness.target, shard_pb2.OperatorMessage(hello=shard_pb2.Hello(cluster_id="c2")))
    assert err.code() == grpc.StatusCode.UNAVAILABLE


async def test_connected_waits_for_every_named_cluster_up_to_its_timeout() -> None:
    """What a cross-shard drain waits on after a takeover: the victims' operators reconnecting."""
    reg = SessionRegistry()
    assert await reg.connected(set(), 0.0)
    waiter = asyncio.create_task(reg.connected({"c0", "c1"}, 10.0))
    await asyncio.sleep(0)
    reg.install(OperatorSession("c0", None, 4096))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert not waiter.done()  # c1 is still missing
    reg.install(OperatorSession("c1", None, 4096))  # type: ignore[arg-type]
    assert await asyncio.wait_for(waiter, 1.0)
    t0 = time.monotonic()
    assert not await reg.connected({"c0", "c9"}, 0.2)
    assert 0.15 <= time.monotonic() - t0 < 2.0
