"""The asyncio gRPC shell around the pure core: answers the six RPCs, runs substrate work.

One event loop serialises every state change (no await between the fence check
and the accept), so concurrent calls cannot interleave inside a decision. A
state change is persisted (group commit) before the call is answered. The
substrate work of an accepted transition runs as a task under its kind's
timeout; when the deadline passes the machine goes FAILED at once, and any
late answer from the backend is dropped by the core's operation-id check.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from bigfleet.observability import get_logger
from bigfleet.provider.kit.backend import (
    Backend,
    ConfigureCall,
    CreateCall,
    CreateResult,
    DeleteCall,
    DrainCall,
)
from bigfleet.provider.kit.core import ProviderCore, check_configure_args
from bigfleet.provider.kit.model import Fence, Kind, KitError, MachineRecord, State
from bigfleet.provider.kit.model import _bytes_field as _field
from bigfleet.provider.kit.store import GroupCommitter, NullStore, Store
from bigfleet.rpc import new_server
from bigfleet.v1alpha1 import provider_pb2

SERVICE = "bigfleet.v1alpha1.CapacityProvider"
HEALTH_SERVICE = SERVICE


@dataclass
class KitOptions:
    create_timeout: float = 300.0
    configure_timeout: float = 300.0
    drain_timeout: float = 600.0
    delete_timeout: float = 300.0
    describe_timeout: float = 30.0
    require_zone: bool = False
    op_prefix: str = "op"
    # Seed for List's order randomisation; None draws one from the OS.
    list_seed: int | None = None
    # How long close() lets running transitions finish before cancelling them.
    stop_grace: float = 2.0
    extra: dict[str, Any] = field(default_factory=dict)

    def timeout(self, kind: Kind) -> float:
        return {
            Kind.CREATE: self.create_timeout,
            Kind.CONFIGURE: self.configure_timeout,
            Kind.DRAIN: self.drain_timeout,
            Kind.DELETE: self.delete_timeout,
        }[kind]


def encode_ack(op_id: str, rec: MachineRecord) -> bytes:
    """TransitionAck bytes, built from the record's cached Machine encoding."""
    return _field(0x0A, op_id.encode()) + _field(0x12, rec.wire())


def encode_list(records: list[MachineRecord], rev: int) -> bytes:
    """MachineList bytes: repeated field 1 from cached encodings, then the revision (field 2)."""
    return b"".join([r.framed() for r in records]) + _field(0x12, str(rev).encode())


class _Metrics:
    def __init__(self, registry: CollectorRegistry, core: ProviderCore) -> None:
        self.rpcs = Counter("bigfleet_provider_rpcs_total", "Provider RPCs answered", ["method", "code"],
                            registry=registry)
        self.rpc_seconds = Histogram(
            "bigfleet_provider_rpc_duration_seconds", "Provider RPC handling time", ["method"], registry=registry,
            buckets=[0.0005 * 2**i for i in range(14)],
        )
        self.transitions = Counter("bigfleet_provider_transitions_total", "Transitions finished",
                                   ["kind", "outcome"], registry=registry)

        class _Inventory:
            def collect(self_inner) -> Any:
                g = GaugeMetricFamily("bigfleet_provider_machines", "Machines by state", labels=["state"])
                counts = dict.fromkeys(State, 0)
                for rec in list(core.machines.values()):
                    counts[rec.state] += 1
                for s, n in counts.items():
                    if s != State.UNSPECIFIED:
                        g.add_metric([s.name], n)
                yield g
                r = GaugeMetricFamily("bigfleet_provider_revision", "Current List revision")
                r.add_metric([], core.rev)
                yield r

        registry.register(_Inventory())


class ProviderServer:
    """A backend wrapped in the whole provider contract; register it on a grpc.aio server."""

    def __init__(
        self,
        backend: Backend,
        store: Store | None = None,
        options: KitOptions | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.backend = backend
        self.store: Store = store if store is not None else NullStore()
        self.options = options or KitOptions()
        self.core = ProviderCore(op_prefix=self.options.op_prefix, supports_delete=backend.supports_delete)
        self.committer = GroupCommitter(self.store, self.core)
        self.rng = random.Random(self.options.list_seed)
        self.log = get_logger("bigfleet.provider.kit")
        self.metrics = _Metrics(registry or CollectorRegistry(), self.core)
        self._tasks: set[asyncio.Task[None]] = set()
        self._orphans: set[asyncio.Future[Any]] = set()
        self._readiness_warned = False
        self.started = False

    # ---- lifecycle of the server itself ----------------------------------------------------------

    async def start(self) -> None:
        """Load the store; seed from the backend on first boot, else recover interrupted work."""
        snap = self.store.load()
        if snap is not None:
            self.core.restore(snap)
        if self.core.is_fresh:
            instances = await asyncio.wait_for(self.backend.describe(), self.options.describe_timeout)
            n = self.core.seed(instances, self.options.require_zone)
            self.log.info("provider seeded from backend", machines=n, revision=self.core.rev)
        else:
            failed = self.core.recover_interrupted()
            self.log.info("provider state reloaded", machines=len(self.core.machines), revision=self.core.rev,
                          interrupted=len(failed))
        await self.committer.flush()
        for rec in self.core.machines.values():
            rec.framed()  # encode once at boot, so the first List of a big fleet is as fast as the rest
        self.started = True

    async def reconcile(self) -> int:
        """Fold a fresh Describe in (prices, probabilities, shapes, new machines); returns changes."""
        instances = await asyncio.wait_for(self.backend.describe(), self.options.describe_timeout)
        changed, skipped = self.core.reconcile(instances, self.options.require_zone)
        for why in skipped:
            self.log.warning("reconcile skipped an invalid record", reason=why)
        await self.committer.flush()
        return changed

    async def wait_transitions(self, timeout: float | None = None) -> None:
        """Wait until no transition is running (tests and graceful stop)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    async def close(self, grace: float | None = None) -> None:
        grace = self.options.stop_grace if grace is None else grace
        if self._tasks and grace > 0:
            await asyncio.wait(set(self._tasks), timeout=grace)
        pending = list(self._tasks) + list(self._orphans)
        for t in pending:
            t.cancel()
        if pending:
            # A backend that ignores cancellation is not waited for beyond a moment.
            await asyncio.wait(pending, timeout=1.0)
        await self.committer.flush()

    # ---- the six RPCs (bytes out, so List of a big fleet skips re-encoding) -------------------------

    async def _mutate(self, kind: Kind, machine_id: str, fence: Fence, extra: dict[str, Any]) -> bytes:
        try:
            ack = self.core.mutate(kind, machine_id, fence, extra.get("cluster_id", ""), extra.get("metadata"))
        except KitError:
            await self.committer.flush()  # a passing fence still moved the mark
            raise
        live = self.core.machines[machine_id]
        reply = encode_ack(ack.operation_id, live if live.modified == ack.machine.modified else ack.machine)
        await self.committer.flush()  # durable before any substrate work starts
        if ack.started:
            self._spawn(kind, ack.machine, ack.operation_id, extra)
        return reply

    async def create(self, req: provider_pb2.CreateRequest) -> bytes:
        return await self._mutate(
            Kind.CREATE, req.machine_id, Fence(req.shard_id, req.shard_epoch, req.sequence_number), {}
        )

    async def configure(self, req: provider_pb2.ConfigureRequest) -> bytes:
        if not req.machine_id:
            raise KitError(grpc.StatusCode.INVALID_ARGUMENT, "machine_id is empty")
        metadata = dict(req.shard_metadata)
        check_configure_args(req.cluster_id, metadata, len(req.bootstrap_blob))
        return await self._mutate(
            Kind.CONFIGURE, req.machine_id, Fence(req.shard_id, req.shard_epoch, req.sequence_number),
            {"cluster_id": req.cluster_id, "metadata": metadata, "blob": bytes(req.bootstrap_blob)},
        )

    async def drain(self, req: provider_pb2.DrainRequest) -> bytes:
        if not req.machine_id:
            raise KitError(grpc.StatusCode.INVALID_ARGUMENT, "machine_id is empty")
        if req.grace_period_seconds < 0:
            raise KitError(grpc.StatusCode.INVALID_ARGUMENT, "grace_period_seconds must be >= 0")
        return await self._mutate(
            Kind.DRAIN, req.machine_id, Fence(req.shard_id, req.shard_epoch, req.sequence_number),
            {"grace": int(req.grace_period_seconds)},
        )

    async def delete(self, req: provider_pb2.DeleteRequest) -> bytes:
        return await self._mutate(
            Kind.DELETE, req.machine_id, Fence(req.shard_id, req.shard_epoch, req.sequence_number), {}
        )

    async def get(self, req: provider_pb2.MachineRef) -> bytes:
        return self.core.get(req.id).wire()

    async def list(self, req: provider_pb2.ListFilter) -> bytes:
        records, rev = self.core.list(list(req.states), req.max_results, bytes(req.since_revision), self.rng)
        return encode_list(records, rev)

    # ---- substrate work --------------------------------------------------------------------------

    def _spawn(self, kind: Kind, rec: MachineRecord, op_id: str, extra: dict[str, Any]) -> None:
        task = asyncio.create_task(self._run(kind, rec, op_id, extra), name=f"{kind.value}:{rec.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _work(self, kind: Kind, rec: MachineRecord, op_id: str, extra: dict[str, Any]) -> CreateResult | None:
        if kind == Kind.CREATE:
            return await self.backend.create_instance(CreateCall(rec, op_id))
        if kind == Kind.CONFIGURE:
            call = ConfigureCall(rec, extra["cluster_id"], extra["blob"], op_id, dict(extra["metadata"]))
            await self.backend.configure_instance(call)
            try:
                await self.backend.confirm_node_ready(call)
            except Exception as exc:
                raise RuntimeError(f"node readiness: {exc}") from exc
            return None
        if kind == Kind.DRAIN:
            await self.backend.drain_instance(DrainCall(rec, extra["grace"], op_id))
            return None
        await self.backend.delete_instance(DeleteCall(rec, op_id))
        return None

    async def _run(self, kind: Kind, rec: MachineRecord, op_id: str, extra: dict[str, Any]) -> None:
        """Run the substrate work; a timer declares it FAILED at the deadline without waiting for it.

        One task and one timer handle per transition (no extra futures): this
        path runs for every lifecycle call, so it is kept lean.
        """
        timeout = self.options.timeout(kind)
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        timer = loop.call_later(timeout, self._on_timeout, kind, rec.id, op_id, timeout, task)
        result: CreateResult | None = None
        error: str | None = None
        outcome = "success"
        try:
            result = await self._work(kind, rec, op_id, extra)
        except asyncio.CancelledError:
            if timer.cancelled() or loop.time() < timer.when():
                timer.cancel()
                raise  # the server is closing: leave the machine for restart recovery
            return  # cancelled by our own timeout, which already recorded the failure
        except Exception as exc:
            error, outcome = f"{kind.value} failed: {exc or type(exc).__name__}", "failed"
        finally:
            timer.cancel()
        self._finish(kind, rec.id, op_id, error, outcome, result)
        await self.committer.flush()

    def _on_timeout(self, kind: Kind, mid: str, op_id: str, timeout: float, task: asyncio.Task[Any] | None) -> None:
        self._finish(kind, mid, op_id, f"{kind.value} transition timed out after {timeout:g}s", "timeout", None)
        if task is not None:
            # The task keeps running if the backend ignores cancellation; its late answer is dropped.
            task.cancel()
            self._orphans.add(task)
            task.add_done_callback(self._orphan_done)
        flush = asyncio.ensure_future(self.committer.flush())
        self._orphans.add(flush)
        flush.add_done_callback(self._orphan_done)

    def _finish(self, kind: Kind, mid: str, op_id: str, error: str | None, outcome: str,
                result: CreateResult | None) -> None:
        applied = self.core.complete(
            mid, kind, op_id, error,
            host=result.host if result else None,
            resources=result.resources if result else None,
            allocatable=result.allocatable if result else None,
        )
        if not applied:
            outcome = "stale"
        self.metrics.transitions.labels(kind.value, outcome).inc()
        if error is not None and applied:
            self.log.warning("transition failed", machine=mid, kind=kind.value, operation_id=op_id, error=error)

    def _orphan_done(self, fut: asyncio.Future[Any]) -> None:
        self._orphans.discard(fut)
        if not fut.cancelled():
            fut.exception()  # retrieve, so asyncio does not warn; the result was already discarded

    # ---- gRPC wiring -----------------------------------------------------------------------------

    def _handler(self, method: str, fn: Callable[[Any], Awaitable[bytes]], msg: Any) -> Callable[..., Awaitable[bytes]]:
        rpcs, seconds, log = self.metrics.rpcs, self.metrics.rpc_seconds.labels(method), self.log
        parse = msg.FromString
        counted = {"OK": rpcs.labels(method, "OK")}  # labels() per call is a lock and a dict walk

        async def handle(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
            t0 = time.perf_counter()
            code = "OK"
            try:
                try:
                    request = parse(raw)
                except Exception as exc:  # malformed bytes or invalid UTF-8 in a string field
                    raise KitError(grpc.StatusCode.INVALID_ARGUMENT, f"cannot parse {method} request: {exc}") from None
                return await fn(request)
            except KitError as exc:
                code = exc.code.name
                await context.abort(exc.code, exc.message)
            except Exception as exc:
                code = "INTERNAL"
                log.exception("provider RPC crashed", method=method)
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc}")
            finally:
                seconds.observe(time.perf_counter() - t0)
                child = counted.get(code)
                if child is None:
                    child = counted[code] = rpcs.labels(method, code)
                child.inc()
            raise AssertionError("unreachable")

        return handle

    def generic_handler(self) -> grpc.GenericRpcHandler:
        def ident(b: bytes) -> bytes:
            return b

        table: dict[str, tuple[Callable[[Any], Awaitable[bytes]], Any]] = {
            "Create": (self.create, provider_pb2.CreateRequest),
            "Configure": (self.configure, provider_pb2.ConfigureRequest),
            "Drain": (self.drain, provider_pb2.DrainRequest),
            "Delete": (self.delete, provider_pb2.DeleteRequest),
            "Get": (self.get, provider_pb2.MachineRef),
            "List": (self.list, provider_pb2.ListFilter),
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                self._handler(name, fn, msg), request_deserializer=ident, response_serializer=ident,
            )
            for name, (fn, msg) in table.items()
        }
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    def register(self, server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((self.generic_handler(),))


@dataclass
class RunningProvider:
    provider: ProviderServer
    server: grpc.aio.Server
    port: int

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        await self.provider.close()


async def serve(
    backend: Backend,
    listen: str = "127.0.0.1:0",
    store: Store | None = None,
    options: KitOptions | None = None,
    registry: CollectorRegistry | None = None,
    tls: Any = None,
) -> RunningProvider:
    """Start a provider on ``listen`` (port 0 picks one) with the health service SERVING.

    ``tls`` (a ``bigfleet.security.TLSConfig``) serves mTLS and enforces the provider role
    policy: mutations only from ``bigfleet://shard/<id>`` acting as itself (protocols.md §8).
    """
    from bigfleet.rpc.options import SERVING

    provider = ProviderServer(backend, store, options, registry)
    await provider.start()
    from bigfleet.security import add_port

    if tls is None:
        server, health = new_server()
    else:
        from bigfleet.security import PROVIDER_POLICY, RoleInterceptor

        roles = RoleInterceptor(PROVIDER_POLICY, registry=registry, component="provider")
        server, health = new_server(interceptors=[roles])
    provider.register(server)
    port = add_port(server, listen, tls)  # (OSError naming the address when it cannot be bound)
    await server.start()
    await health.set("", SERVING)
    await health.set(HEALTH_SERVICE, SERVING)
    return RunningProvider(provider, server, port)
