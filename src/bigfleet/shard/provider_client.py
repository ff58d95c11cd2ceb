"""Client side of the provider contract: deadlines, bounded retries, fencing tokens.

Every attempt of a mutating call draws a fresh sequence number (the provider
accepts only a strictly newer token per machine, and a retry of a call that
did land must not be refused as a replay of itself). FAILED_PRECONDITION is
the provider's fencing answer: we are a zombie, never retry it. ALREADY_EXISTS,
ABORTED and NOT_FOUND are conflict answers (someone else holds the machine, or
it is gone): the executor re-reads the machine instead of failing it. A call in
the wrong state is answered with another code (the provider kit: INTERNAL),
so the executor tells a race from a failure by the record it re-reads.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from bigfleet.rpc import channel_options
from bigfleet.rpc.options import without_keepalive
from bigfleet.security.tls import TLSConfig
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.v1alpha1 import provider_pb2, provider_pb2_grpc

T = TypeVar("T")

RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
     grpc.StatusCode.ABORTED, grpc.StatusCode.UNKNOWN}
)


# Answers that mean "lost a race", never "the machine is broken" (the contract reserves
# FAILED_PRECONDITION for fencing; ABORTED is retried first, like the other transient codes).
CONFLICT_CODES = frozenset({grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.ABORTED, grpc.StatusCode.NOT_FOUND})


# No answer about the machine at all (the provider could not be reached in time, retries included).
NO_ANSWER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED})


class ProviderError(Exception):
    def __init__(self, rpc: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"provider {rpc}: {code.name}: {details}")
        self.rpc = rpc
        self.code = code
        self.details = details

    @property
    def fenced(self) -> bool:
        return bool(self.code == grpc.StatusCode.FAILED_PRECONDITION)

    @property
    def no_answer(self) -> bool:
        """The provider never answered (unreachable or too slow, after the client's retries)."""
        return self.code in NO_ANSWER_CODES

    @property
    def conflict(self) -> bool:
        """Another actor holds the machine (bound elsewhere, a concurrent change) or it is gone."""
        return self.code in CONFLICT_CODES


class ProviderClient:
    """One provider over gRPC; also its own (only) List source, answering for every machine id."""

    #: as a reconcile source (bigfleet.shard.providers.ListSource): unnamed, every id is its own
    name = ""
    prefix = ""

    def __init__(
        self,
        target: str,
        shard_id: str,
        shard_epoch: int,
        metrics: ShardMetrics | None = None,
        lifecycle_timeout: float = 30.0,
        list_timeout: float = 120.0,
        attempt_timeout: float = 10.0,
        max_attempts: int = 4,
        backoff: float = 0.2,
        tls: TLSConfig | None = None,
        stub: Any = None,
        clock: Callable[[], float] = time.monotonic,
        channels: int = 1,
    ) -> None:
        self.target = target
        self.shard_id = shard_id
        self.shard_epoch = shard_epoch
        self._metrics = metrics
        # No keepalive pings: calls flow every reconcile anyway, and providers built on default
        # server settings answer frequent idle pings with GOAWAY "too_many_pings".
        self._clock = clock
        # ``stub`` replaces the wire (the simulator passes an in-process provider with the same shape).
        # ``channels`` > 1 opens that many HTTP/2 connections (a private subchannel pool each) and
        # spreads calls over them round-robin.
        self._channels: list[Any] = []
        for _ in range(max(1, channels) if stub is None else 0):
            if tls is None:
                opts = without_keepalive(channel_options())
            else:  # mTLS: we present bigfleet://shard/<id>
                opts = without_keepalive(tls.channel_options())
            if channels > 1:
                opts.append(("grpc.use_local_subchannel_pool", 1))
            if tls is None:
                self._channels.append(grpc.aio.insecure_channel(target, options=opts))
            else:
                self._channels.append(grpc.aio.secure_channel(target, tls.channel_credentials(), options=opts))
        self._channel: Any = self._channels[0] if self._channels else None
        self._stubs: list[Any] = [stub] if stub is not None else [
            provider_pb2_grpc.CapacityProviderStub(ch) for ch in self._channels]
        self._stub: Any = self._stubs[0]
        self._rr = itertools.cycle(self._stubs)
        # Per-RPC metric children, resolved once (labels() is a lock and a dict walk per call).
        self._rpc_hist: dict[str, Any] = {}
        self._seq = itertools.count(1)
        self.lifecycle_timeout = lifecycle_timeout
        self.list_timeout = list_timeout
        self.attempt_timeout = attempt_timeout
        self.max_attempts = max_attempts
        self.backoff = backoff
        # Stamped into every Configure's shard_metadata (the handoff's owner key; empty = nothing).
        self.extra_metadata: dict[str, str] = {}

    def sources(self) -> tuple[ProviderClient]:
        return (self,)

    def ownership_for(self, machine_id: str) -> str | None:
        return None  # the shard's --ownership

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()

    def _pick(self) -> Any:
        return next(self._rr) if len(self._stubs) > 1 else self._stub

    def _hist(self, rpc: str) -> Any:
        h = self._rpc_hist.get(rpc)
        if h is None and self._metrics is not None:
            h = self._rpc_hist[rpc] = self._metrics.provider_rpc.labels(rpc)
        return h

    def next_sequence(self) -> int:
        return next(self._seq)

    async def _call(self, rpc: str, fn: Callable[[float], Awaitable[T]], total: float) -> T:
        deadline = self._clock() + total
        delay = self.backoff
        attempt = 0
        while True:
            attempt += 1
            remaining = deadline - self._clock()
            per = max(0.05, min(self.attempt_timeout, remaining))
            start = time.perf_counter()
            try:
                result = await fn(per)
                if self._metrics:
                    self._hist(rpc).observe(time.perf_counter() - start)
                return result
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if self._metrics:
                    self._hist(rpc).observe(time.perf_counter() - start)
                    self._metrics.provider_errors.labels(rpc, code.name).inc()
                remaining = deadline - self._clock()
                if code not in RETRYABLE or attempt >= self.max_attempts or remaining <= delay:
                    raise ProviderError(rpc, code, exc.details() or "") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _token(self) -> dict[str, Any]:
        return {"shard_id": self.shard_id, "shard_epoch": self.shard_epoch, "sequence_number": self.next_sequence()}

    async def create(self, machine_id: str) -> provider_pb2.TransitionAck:
        return await self._call(
            "Create",
            lambda t: self._pick().Create(provider_pb2.CreateRequest(machine_id=machine_id, **self._token()), timeout=t),
            self.lifecycle_timeout,
        )

    async def configure(
        self, machine_id: str, cluster_id: str, blob: bytes, metadata: dict[str, str]
    ) -> provider_pb2.TransitionAck:
        return await self._call(
            "Configure",
            lambda t: self._pick().Configure(
                provider_pb2.ConfigureRequest(
                    machine_id=machine_id, cluster_id=cluster_id, bootstrap_blob=blob,
                    shard_metadata={**metadata, **self.extra_metadata} if self.extra_metadata else metadata,
                    **self._token(),
                ),
                timeout=t,
            ),
            self.lifecycle_timeout,
        )

    async def drain(self, machine_id: str, grace_period_seconds: int) -> provider_pb2.TransitionAck:
        return await self._call(
            "Drain",
            lambda t: self._pick().Drain(
                provider_pb2.DrainRequest(machine_id=machine_id, grace_period_seconds=grace_period_seconds, **self._token()),
                timeout=t,
            ),
            self.lifecycle_timeout,
        )

    async def delete(self, machine_id: str) -> provider_pb2.TransitionAck:
        return await self._call(
            "Delete",
            lambda t: self._pick().Delete(provider_pb2.DeleteRequest(machine_id=machine_id, **self._token()), timeout=t),
            self.lifecycle_timeout,
        )

    async def get(self, machine_id: str, total: float | None = None) -> provider_pb2.Machine:
        return await self._call(
            "Get",
            lambda t: self._pick().Get(provider_pb2.MachineRef(id=machine_id), timeout=t),
            total or self.lifecycle_timeout,
        )

    async def list(self, since_revision: bytes = b"", total: float | None = None) -> provider_pb2.MachineList:
        return await self._call(
            "List",
            lambda t: self._pick().List(provider_pb2.ListFilter(since_revision=since_revision), timeout=max(t, 5.0)),
            total or self.list_timeout,
        )
