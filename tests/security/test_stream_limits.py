"""Per-session flood control applied by the RoleInterceptor on a real grpc.aio server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client import CollectorRegistry

from bigfleet.rpc import new_server
from bigfleet.security import SHARD_POLICY, RoleInterceptor, add_port, dial
from bigfleet.security.limits import StreamLimit, ThrottleConfig, check_operator_frame, is_rollup_frame
from bigfleet.v1alpha1 import capacity_pb2 as capb
from bigfleet.v1alpha1 import shard_pb2 as spb
from bigfleet.v1alpha1 import shard_pb2_grpc as sgrpc

from .servers import Shard

SESSION = "/bigfleet.v1alpha1.Shard/Session"
LIMIT = StreamLimit(ThrottleConfig(rollups_per_second=5, rollup_burst=3, hard_frames_per_second=50, hard_frame_burst=100),
                    is_rollup_frame, check_operator_frame)


@pytest.fixture
async def shard() -> AsyncIterator[tuple[int, CollectorRegistry]]:
    registry = CollectorRegistry()
    server, _ = new_server(interceptors=[RoleInterceptor(SHARD_POLICY, registry=registry, component="shard",
                                                         stream_limits={SESSION: LIMIT})])
    sgrpc.add_ShardServicer_to_server(Shard(), server)
    port = add_port(server, "127.0.0.1:0", None)
    await server.start()
    yield port, registry
    await server.stop(None)


def rollup(cluster: str) -> spb.OperatorMessage:
    return spb.OperatorMessage(rollup=capb.ClusterCapacityNeeds(cluster_id=cluster))


async def open_session(ch: grpc.aio.Channel, cluster: str) -> grpc.aio.StreamStreamCall:
    call = sgrpc.ShardStub(ch).Session(timeout=60)
    await call.write(spb.OperatorMessage(hello=spb.Hello(cluster_id=cluster)))
    assert (await call.read()).ack.echo == "hello"
    return call


async def test_rollup_flood_is_paced_on_its_own_session_only(shard: tuple[int, CollectorRegistry]) -> None:
    port, registry = shard
    async with dial(f"127.0.0.1:{port}", None) as ch1, dial(f"127.0.0.1:{port}", None) as ch2:
        noisy = await open_session(ch1, "noisy")
        quiet = await open_session(ch2, "quiet")
        sent = 12
        for _ in range(sent):
            await noisy.write(rollup("noisy"))
        # While the noisy session is being paced, the quiet one is answered at once.
        order: list[str] = []

        async def drain_noisy() -> None:
            for _ in range(sent):
                assert (await noisy.read()).ack.echo == "rollup"
                order.append("noisy")

        task = asyncio.create_task(drain_noisy())
        await quiet.write(rollup("quiet"))
        assert (await quiet.read()).ack.echo == "rollup"
        order.append("quiet")
        await task
        assert order.index("quiet") < sent, order  # quiet was not queued behind the flood
        deferred = registry.get_sample_value("bigfleet_shard_stream_throttled_total",
                                             {"method": SESSION, "action": "defer"})
        assert deferred is not None and deferred >= sent - 3  # everything past the burst was paced
        for call in (noisy, quiet):
            await call.done_writing()


async def test_frame_flood_closes_only_that_session(shard: tuple[int, CollectorRegistry]) -> None:
    port, registry = shard
    async with dial(f"127.0.0.1:{port}", None) as ch:
        flood = await open_session(ch, "flood")
        calm = await open_session(ch, "calm")

        # 150 frames at once: past the hard burst (100) long before 50/s refills it. Hello
        # frames are never paced, they only count against the hard bucket.
        for _ in range(150):
            await flood.write(spb.OperatorMessage(hello=spb.Hello(cluster_id="flood")))
        await flood.done_writing()
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            while (await flood.read()) is not grpc.aio.EOF:
                pass
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value.details()
        closes = registry.get_sample_value("bigfleet_shard_stream_throttled_total", {"method": SESSION, "action": "close"})
        assert closes == 1
        await calm.write(rollup("calm"))
        assert (await calm.read()).ack.echo == "rollup"
        await calm.done_writing()


async def test_oversized_bootstrap_blob_closes_only_that_session(shard: tuple[int, CollectorRegistry]) -> None:
    port, registry = shard
    async with dial(f"127.0.0.1:{port}", None) as ch:
        big = await open_session(ch, "big")
        calm = await open_session(ch, "calm")
        blob = spb.BootstrapBlobResponse(request_id="r1", user_data=b"x" * ((1 << 20) + 1))
        await big.write(spb.OperatorMessage(bootstrap_response=blob))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            while (await big.read()) is not grpc.aio.EOF:
                pass
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "user_data" in (ei.value.details() or "")
        assert registry.get_sample_value("bigfleet_shard_stream_throttled_total",
                                         {"method": SESSION, "action": "oversize"}) == 1
        ok = spb.BootstrapBlobResponse(request_id="r2", user_data=b"#cloud-config\n")
        await calm.write(spb.OperatorMessage(bootstrap_response=ok))
        await calm.write(rollup("calm"))
        assert (await calm.read()).ack.echo == "rollup"  # the ack for the bootstrap response frame
        await calm.done_writing()
