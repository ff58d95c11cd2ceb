"""A recording pass-through in front of a real provider process: every call the shard makes is
forwarded unchanged and kept for assertions (blobs, fencing tokens, how often each machine was created)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc

from bigfleet.rpc import insecure_channel, new_server
from bigfleet.v1alpha1 import provider_pb2, provider_pb2_grpc


class SpyProvider(provider_pb2_grpc.CapacityProviderServicer):
    def __init__(self, upstream: str) -> None:
        self.channel = insecure_channel(upstream)
        self.stub = provider_pb2_grpc.CapacityProviderStub(self.channel)
        self.calls: list[tuple[str, Any]] = []

    async def _fwd(self, name: str, req: Any, fn: Callable[..., Awaitable[Any]], context: grpc.aio.ServicerContext) -> Any:
        self.calls.append((name, req))
        remaining = context.time_remaining()
        try:
            return await fn(req, timeout=remaining if remaining is not None else 30)
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")

    async def Create(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Create", request, self.stub.Create, context)

    async def Configure(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Configure", request, self.stub.Configure, context)

    async def Drain(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Drain", request, self.stub.Drain, context)

    async def Delete(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Delete", request, self.stub.Delete, context)

    async def Get(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Get", request, self.stub.Get, context)

    async def List(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("List", request, self.stub.List, context)

    # -- assertions helpers --------------------------------------------------------------------

    def of(self, name: str) -> list[Any]:
        return [r for n, r in self.calls if n == name]

    def per_machine(self, name: str) -> Counter[str]:
        return Counter(r.machine_id for r in self.of(name))

    async def list_machines(self) -> list[provider_pb2.Machine]:
        return list((await self.stub.List(provider_pb2.ListFilter(), timeout=10)).machines)


@asynccontextmanager
async def spy_provider(upstream: str, tls: Any = None) -> AsyncIterator[tuple[SpyProvider, str]]:
    """``tls`` (a TLSConfig) makes the pass-through serve mTLS while the upstream stays plaintext."""
    from bigfleet.security.tls import add_port

    spy = SpyProvider(upstream)
    server, _ = new_server()
    provider_pb2_grpc.add_CapacityProviderServicer_to_server(spy, server)
    port = add_port(server, "127.0.0.1:0", tls)
    await server.start()
    try:
        yield spy, f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
        await spy.channel.close()


async def until(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition", interval: float = 0.05) -> Any:
    """Async condition wait: returns the predicate's first truthy value, or raises naming ``what``."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            v = pred()
            if asyncio.iscoroutine(v):
                v = await v
            if v:
                return v
        except Exception as exc:
            last = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last!r})" if last else ""))
        await asyncio.sleep(interval)
