"""Request metadata ≤ 64 entries / 16 KiB (docs/security.md), on real loopback gRPC servers.

Every server built by ``bigfleet.rpc.new_server`` (coordinator, provider kit) refuses a call over
either bound with INVALID_ARGUMENT naming it, before the handler runs; gRPC's own header limit
no longer answers first (it refused at random from 8 KiB, with RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bigfleet.provider.fake.backend import SimulatedCloud
from bigfleet.provider.fake.catalog import build_catalog
from bigfleet.provider.kit import serve
from bigfleet.rpc import insecure_channel, new_server
from bigfleet.security import RoleInterceptor
from bigfleet.v1alpha1 import provider_pb2 as pb
from bigfleet.v1alpha1 import provider_pb2_grpc as pbg

TOO_MANY = [(f"x-k{i}", "v") for i in range(70)]  # 70 entries, 1 KiB in all
TOO_BIG = [(f"x-k{i}", "v" * 1000) for i in range(20)]  # 20 entries, ~20 KiB
FINE = [(f"x-k{i}", "v" * 1000) for i in range(12)]  # 12 entries, ~12 KiB (over gRPC's old 8 KiB soft limit)


@pytest.fixture
async def health_target() -> AsyncIterator[str]:
    server, _health = new_server(interceptors=[RoleInterceptor({})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def _code(call: object) -> tuple[grpc.StatusCode, str]:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize(("metadata", "what"), [(TOO_MANY, "more than 64 entries"), (TOO_BIG, "more than 16384 bytes")],
                         ids=["entries", "bytes"])
async def test_unary_call_over_the_metadata_limit_is_invalid_argument(
        health_target: str, metadata: list[tuple[str, str]], what: str) -> None:
    async with insecure_channel(health_target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        code, details = await _code(stub.Check(health_pb2.HealthCheckRequest(), metadata=metadata, timeout=10))
        assert code is grpc.StatusCode.INVALID_ARGUMENT
        assert what in details and "request metadata" in details
        # the same channel still works for a call within the limits
        ok = await stub.Check(health_pb2.HealthCheckRequest(), metadata=FINE, timeout=10)
        assert ok.status == health_pb2.HealthCheckResponse.SERVING


async def test_streaming_call_over_the_metadata_limit_is_invalid_argument(health_target: str) -> None:
    async with insecure_channel(health_target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        call = stub.Watch(health_pb2.HealthCheckRequest(), metadata=TOO_MANY, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for _ in call:
                pass
        assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "more than 64 entries" in (ei.value.details() or "")


async def test_provider_kit_server_refuses_oversized_metadata() -> None:
    running = await serve(SimulatedCloud(build_catalog(4)))
    try:
        async with insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = pbg.CapacityProviderStub(ch)
            listed = await stub.List(pb.ListFilter(), metadata=FINE, timeout=10)
            assert listed.machines
            for md in (TOO_MANY, TOO_BIG):
                code, details = await _code(stub.List(pb.ListFilter(), metadata=md, timeout=10))
                assert code is grpc.StatusCode.INVALID_ARGUMENT, details
    finally:
        await running.stop()


def test_transport_header_limit_sits_above_the_documented_bound() -> None:
    from bigfleet.rpc import server_options
    from bigfleet.security.metadata import TRANSPORT_METADATA_BYTES

    opts = dict(server_options())
    assert opts["grpc.max_metadata_size"] == opts["grpc.absolute_max_metadata_size"] == TRANSPORT_METADATA_BYTES
    assert TRANSPORT_METADATA_BYTES > 16 << 10
