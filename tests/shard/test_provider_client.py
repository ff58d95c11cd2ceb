"""Provider client against a scripted provider on a real grpc.aio server: fencing tokens, retries,
no retry on fencing, deadlines."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from bigfleet.rpc import new_server
from bigfleet.shard.provider_client import ProviderClient, ProviderError
from bigfleet.v1alpha1 import provider_pb2, provider_pb2_grpc


class Scripted(provider_pb2_grpc.CapacityProviderServicer):
    def __init__(self) -> None:
        self.creates: list[provider_pb2.CreateRequest] = []
        self.fail_next: list[grpc.StatusCode] = []
        self.hang = False

    async def Create(self, request: provider_pb2.CreateRequest, context: grpc.aio.ServicerContext) -> provider_pb2.TransitionAck:
        self.creates.append(request)
        if self.hang:
            await asyncio.sleep(30)
        if self.fail_next:
            await context.abort(self.fail_next.pop(0), "scripted")
        return provider_pb2.TransitionAck(operation_id="op-1", machine=provider_pb2.Machine(
            id=request.machine_id, state=provider_pb2.MACHINE_STATE_CREATING))


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[Scripted, str]]:
    svc = Scripted()  # type: ignore[abstract]
    server, _ = new_server()
    provider_pb2_grpc.add_CapacityProviderServicer_to_server(svc, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield svc, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


async def test_retries_transient_errors_with_fresh_sequence(scripted: tuple[Scripted, str]) -> None:
    svc, target = scripted
    client = ProviderClient(target, "shard-a", 4, backoff=0.01)
    try:
        svc.fail_next = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
        ack = await client.create("m-1")
        assert ack.machine.state == provider_pb2.MACHINE_STATE_CREATING
        assert len(svc.creates) == 3
        seqs = [r.sequence_number for r in svc.creates]
        assert seqs == sorted(set(seqs)) and all(s > 0 for s in seqs)
        assert {(r.shard_id, r.shard_epoch) for r in svc.creates} == {("shard-a", 4)}
    finally:
        await client.close()


async def test_fencing_is_never_retried(scripted: tuple[Scripted, str]) -> None:
    svc, target = scripted
    client = ProviderClient(target, "shard-a", 1, backoff=0.01)
    try:
        svc.fail_next = [grpc.StatusCode.FAILED_PRECONDITION]
        with pytest.raises(ProviderError) as ei:
            await client.create("m-1")
        assert ei.value.fenced
        assert len(svc.creates) == 1
        svc.fail_next = [grpc.StatusCode.INTERNAL]
        with pytest.raises(ProviderError) as ei2:
            await client.create("m-1")
        assert not ei2.value.fenced and ei2.value.code == grpc.StatusCode.INTERNAL
        assert len(svc.creates) == 2
    finally:
        await client.close()


async def test_deadline_bounds_a_hanging_provider(scripted: tuple[Scripted, str]) -> None:
    svc, target = scripted
    svc.hang = True
    client = ProviderClient(target, "shard-a", 1, lifecycle_timeout=0.6, attempt_timeout=0.2, backoff=0.05)
    try:
        with pytest.raises(ProviderError) as ei:
            await client.create("m-1")
        assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 1 <= len(svc.creates) <= 4
    finally:
        await client.close()


async def test_unreachable_provider_is_unavailable() -> None:
    from bigfleet.testing import free_port

    client = ProviderClient(f"127.0.0.1:{free_port()}", "shard-a", 1, lifecycle_timeout=0.5, backoff=0.05)
    try:
        with pytest.raises(ProviderError) as ei:
            await client.list()
        assert ei.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        await client.close()
