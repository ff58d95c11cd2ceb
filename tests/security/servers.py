"""Small real servicers used by the mTLS tests: the role policy is what is under test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from bigfleet.rpc import new_server
from bigfleet.security import (
    COORDINATOR_POLICY,
    SHARD_POLICY,
    RoleInterceptor,
    TLSConfig,
    add_port,
    require_cluster,
    require_shard,
)
from bigfleet.v1alpha1 import (
    coordinator_pb2 as cpb,
)
from bigfleet.v1alpha1 import (
    coordinator_pb2_grpc as cgrpc,
)
from bigfleet.v1alpha1 import (
    shard_pb2 as spb,
)
from bigfleet.v1alpha1 import (
    shard_pb2_grpc as sgrpc,
)


class Coordinator(cgrpc.CoordinatorServicer):
    def __init__(self) -> None:
        self.domains: list[tuple[str, str, str]] = []

    async def ReportShard(self, request: cpb.ShardReport, context: grpc.aio.ServicerContext) -> cpb.ReportAck:
        if not request.shard_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "shard_id is required")
        await require_shard(context, request.shard_id)  # belt and braces next to the interceptor
        return cpb.ReportAck(acknowledged=True)

    async def AssignDomain(self, request: Any, context: grpc.aio.ServicerContext) -> cpb.AssignDomainResponse:
        self.domains.append((request.topology_key, request.topology_value, request.shard_id))
        return cpb.AssignDomainResponse()

    async def ListShards(self, request: Any, context: grpc.aio.ServicerContext) -> cpb.ListShardsResponse:
        return cpb.ListShardsResponse(shards=[cpb.ShardRegistryEntry(shard_id="shard-0")])

    async def SnapshotSave(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[cpb.SnapshotSaveChunk]:
        yield cpb.SnapshotSaveChunk(meta_json=b"{}")
        yield cpb.SnapshotSaveChunk(data=b"x")


class Shard(sgrpc.ShardServicer):
    """Session in the read/write style: Hello, identity check, ack, then echo acks for roll-ups."""

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:  # type: ignore[override]
        first = await context.read()
        if first is grpc.aio.EOF or not first.HasField("hello") or not first.hello.cluster_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first frame must be Hello with cluster_id")
        await require_cluster(context, first.hello.cluster_id)
        await context.write(spb.ShardMessage(ack=spb.Acknowledgement(echo="hello")))
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return
            await context.write(spb.ShardMessage(ack=spb.Acknowledgement(echo="rollup")))


async def start(tls: TLSConfig | None) -> tuple[grpc.aio.Server, int, Coordinator]:
    server, _health = new_server(interceptors=[RoleInterceptor({**COORDINATOR_POLICY, **SHARD_POLICY})])
    coord = Coordinator()  # type: ignore[abstract]
    cgrpc.add_CoordinatorServicer_to_server(coord, server)
    sgrpc.add_ShardServicer_to_server(Shard(), server)
    port = add_port(server, "127.0.0.1:0", tls)
    await server.start()
    return server, port, coord
