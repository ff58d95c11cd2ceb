"""--coordinator mode: the shard is looked up with Coordinator.LookupCluster and cached in a ConfigMap,
so the operator still finds its shard while the coordinator is down."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
from conftest import cr
from fakeshard import FakeShard, eventually

from bigfleet.k8stest import KubeTestServer
from bigfleet.operator.app import SHARD_CACHE_CONFIGMAP, Operator, OperatorConfig
from bigfleet.operator.session import Backoff
from bigfleet.rpc import new_server
from bigfleet.testing import free_port
from bigfleet.v1alpha1 import coordinator_pb2, coordinator_pb2_grpc


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, shard_address: str) -> None:
        self.shard_address = shard_address
        self.lookups: list[str] = []

    async def LookupCluster(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not request.cluster_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "cluster_id is required")
        self.lookups.append(request.cluster_id)
        return coordinator_pb2.LookupClusterResponse(cluster_id=request.cluster_id, shard_id="shard-0",
                                                     shard_address=self.shard_address, binding_epoch=1)


async def test_lookup_cache_and_coordinator_outage(kube: KubeTestServer, api: Any, shard: FakeShard) -> None:
    kube.store.put(cr("a", {"cpu": "1"}))
    fake = FakeCoordinator(shard.target)
    server, _ = new_server()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(fake, server)
    addr = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(addr)
    await server.start()
    dead = f"127.0.0.1:{free_port()}"  # a coordinator replica that is down is skipped

    def make() -> Operator:
        cfg = OperatorConfig(cluster_id="c1", coordinators=(dead, addr), namespace="default",
                             rollup_interval=30.0, debounce=0.05)
        return Operator(cfg, api, backoff=Backoff(initial=0.05, cap=0.2))

    op = make()
    task = asyncio.create_task(op.run())
    try:
        await eventually(lambda: shard.rollups, what="roll-up via coordinator lookup")
        assert fake.lookups == ["c1"]
        cm = kube.store.find("configmaps", SHARD_CACHE_CONFIGMAP, "default")
        assert cm is not None and cm["data"]["shardAddress"] == shard.target
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await server.stop(0)
    # Coordinator down, operator restarted: the cached address still gets it to its shard.
    before = shard.sessions_opened
    op2 = make()
    task2 = asyncio.create_task(op2.run())
    try:
        await eventually(lambda: shard.sessions_opened > before, what="session from the cached address")
    finally:
        task2.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task2
