"""A burst of Session opens (every operator reconnecting after a shard restart) is not refused.

gRPC's server core parks calls the application has not picked up yet and cancels them past
1 000 parked (3 000 hard): a Python server picks calls up one at a time, so 3 000 streams opened
at once lose about a quarter of them (the client sees INTERNAL or CANCELLED and retries). The
shard's server raises those limits. The control run against a default server shows the burst
really does cross the default limit, so the check on ours can fail."""

from __future__ import annotations

import asyncio

import grpc

from bigfleet.rpc import insecure_channel
from bigfleet.shard.cli import SESSION_SERVER_OPTIONS, build_server
from bigfleet.v1alpha1 import shard_pb2, shard_pb2_grpc

BURST = 3000


class _AckHello(shard_pb2_grpc.ShardServicer):
    async def Session(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:  # type: ignore[override]
        await context.read()
        await context.write(shard_pb2.ShardMessage(ack=shard_pb2.Acknowledgement(echo="hello")))
        while await context.read() is not grpc.aio.EOF:
            pass


async def _burst(server: grpc.aio.Server) -> list[str]:
    shard_pb2_grpc.add_ShardServicer_to_server(_AckHello(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channels = [insecure_channel(f"127.0.0.1:{port}", [("grpc.use_local_subchannel_pool", 1)]) for _ in range(2)]
    calls: list[grpc.aio.StreamStreamCall] = []
    errors: list[str] = []

    async def open_one(i: int) -> None:
        call = shard_pb2_grpc.ShardStub(channels[i % 2]).Session()
        calls.append(call)
        try:
            await call.write(shard_pb2.OperatorMessage(hello=shard_pb2.Hello(cluster_id=f"c{i}")))
            msg = await call.read()
            assert msg is not grpc.aio.EOF and msg.ack.echo == "hello"
        except grpc.aio.AioRpcError as exc:
            errors.append(exc.code().name)

    try:
        for ch in channels:
            await asyncio.wait_for(ch.channel_ready(), 10)
        await asyncio.wait_for(asyncio.gather(*(open_one(i) for i in range(BURST))), 120)
    finally:
        for call in calls:
            call.cancel()
        for ch in channels:
            await ch.close()
        await server.stop(None)
    return errors


async def test_default_server_refuses_part_of_a_burst() -> None:
    errors = await _burst(grpc.aio.server())
    assert errors, "the burst no longer crosses gRPC's default pending-call limit; raise BURST"


async def test_shard_server_takes_a_whole_burst() -> None:
    assert ("grpc.server.max_pending_requests", 20_000) in SESSION_SERVER_OPTIONS
    server, _ = build_server()
    assert await _burst(server) == []
