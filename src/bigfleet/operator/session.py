"""The operator's side of ``Shard.Session``: one outbound bidirectional stream to the cluster's shard.

Per connection: ``Hello`` first; then a sender (a one-slot roll-up queue — a
newer roll-up overwrites an unsent one, safe because roll-ups are full
replacement — and a bounded outbox for bootstrap responses and reclaim acks),
a receiver that dispatches shard frames, and a roll-up ticker that asks for a
roll-up at once and then every interval. Any failure ends the connection;
the client redials with jittered exponential backoff (500 ms doubling to
30 s), reset once a session is acknowledged. A session that ends with trailing
metadata ``bigfleet-redirect: host:port`` (a shard that is not the leader, or
is handing the cluster over) is redialled at that address at once. An attempt that then fails
there without a new redirect (the redirect's target is down or no longer leads) is reported to the
resolver, which goes back to its configured address, so a dead leader is not redialled forever.
With mTLS the operator presents its ``bigfleet://cluster/<id>`` certificate.

Losing the shard never changes the cluster: handlers only run for frames the
shard actually sent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from bigfleet.observability import get_logger
from bigfleet.operator.metrics import OperatorMetrics
from bigfleet.security.tls import TLSConfig, dial
from bigfleet.v1alpha1 import capacity_pb2, shard_pb2, shard_pb2_grpc

PROTOCOL_VERSION = "v1alpha1"
OUTBOX_CAPACITY = 256
DISPATCH_CONCURRENCY = 32
REDIRECT_METADATA_KEY = "bigfleet-redirect"
log = get_logger("bigfleet.operator.session")


@dataclass
class Backoff:
    """Exponential backoff with ±``jitter`` proportional noise; pure apart from the injected RNG."""

    initial: float = 0.5
    cap: float = 30.0
    factor: float = 2.0
    jitter: float = 0.2
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0

    def next(self) -> float:
        base = min(self.cap, self.initial * self.factor ** min(self.attempt, 64))
        self.attempt += 1
        return min(self.cap, base * (1.0 - self.jitter + 2.0 * self.jitter * self.rng.random()))

    def reset(self) -> None:
        self.attempt = 0


class Resolver(Protocol):
    async def resolve(self) -> str: ...
    def redirect(self, target: str) -> None: ...
    def failed(self, target: str) -> None:
        """An attempt at ``target`` opened no session and brought no redirect."""
        ...


@dataclass
class StaticResolver:
    """``--shard-addr``: the configured address, or the address a shard's redirect named.

    The redirect's address is kept while sessions open there (a dropped session redials the
    leader directly); once an attempt at it fails without a new redirect (the leader died or
    stepped down) the configured address, a replica or a Service, is dialled again and its
    redirect names whoever leads now.
    """

    target: str
    _override: str | None = None

    async def resolve(self) -> str:
        return self._override or self.target

    def redirect(self, target: str) -> None:
        self._override = None if target == self.target else target

    def failed(self, target: str) -> None:
        if self._override is not None and target == self._override:
            log.info("redirect target failed; back to the configured shard address", failed=target, target=self.target)
            self._override = None


class Handlers(Protocol):
    def bootstrap(self, req: shard_pb2.BootstrapRequest) -> shard_pb2.BootstrapBlobResponse: ...
    async def node_state(self, u: shard_pb2.NodeStateUpdate) -> None: ...
    async def available_capacity(self, u: shard_pb2.AvailableCapacityUpdate) -> None: ...
    async def reclaim(self, ins: shard_pb2.ReclaimInstruction,
                      send_ack: Callable[[shard_pb2.ReclaimAck], None]) -> None: ...


class NodeStateCoalescer:
    """Keeps only the newest pending frame per machine and runs at most one worker per machine."""

    def __init__(self, handler: Callable[[shard_pb2.NodeStateUpdate], Awaitable[None]], sem: asyncio.Semaphore) -> None:
        self.handler = handler
        self.sem = sem
        self.pending: dict[str, shard_pb2.NodeStateUpdate] = {}
        self.running: dict[str, asyncio.Task[None]] = {}
        self.handled = 0

    def offer(self, u: shard_pb2.NodeStateUpdate) -> None:
        self.pending[u.machine_id] = u
        if u.machine_id not in self.running:
            self.running[u.machine_id] = asyncio.create_task(self._worker(u.machine_id))

    async def _worker(self, machine_id: str) -> None:
        try:
            while machine_id in self.pending:
                u = self.pending.pop(machine_id)
                async with self.sem:
                    try:
                        await self.handler(u)
                        self.handled += 1
                    except Exception as exc:
                        log.warning("NodeStateUpdate handler failed", machine=machine_id, error=str(exc)[:300])
        finally:
            self.running.pop(machine_id, None)

    async def idle(self) -> None:
        while self.running:
            await asyncio.gather(*list(self.running.values()), return_exceptions=True)


class SessionEnded(Exception):
    pass


class SessionClient:
    def __init__(
        self,
        cluster_id: str,
        resolver: Resolver,
        handlers: Handlers,
        metrics: OperatorMetrics,
        *,
        request_rollup: Callable[[], Awaitable[object]],
        rollup_interval: float = 10.0,
        backoff: Backoff | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self.cluster_id = cluster_id
        self.tls = tls
        self.resolver = resolver
        self.handlers = handlers
        self.metrics = metrics
        self.request_rollup = request_rollup
        self.rollup_interval = rollup_interval
        self.backoff = backoff or Backoff()
        self._rollup: capacity_pb2.ClusterCapacityNeeds | None = None
        self._outbox: collections.deque[shard_pb2.OperatorMessage] = collections.deque()
        self._wake = asyncio.Event()
        self._sem = asyncio.Semaphore(DISPATCH_CONCURRENCY)
        self.coalescer = NodeStateCoalescer(self._node_state, self._sem)
        self._tasks: set[asyncio.Task[None]] = set()
        self.connected = asyncio.Event()
        self.sessions = 0  # sessions opened (Hello written)
        self.rollups_sent = 0
        self.last_ack: shard_pb2.Acknowledgement | None = None
        self.target: str | None = None
        self._redirect_to: str | None = None

    # -- producers ------------------------------------------------------------------------------
    def offer_rollup(self, msg: capacity_pb2.ClusterCapacityNeeds) -> None:
        """Put a roll-up in the one-slot queue, replacing any unsent one. Never blocks."""
        self._rollup = msg
        self._wake.set()

    def send_response(self, msg: shard_pb2.OperatorMessage) -> bool:
        if len(self._outbox) >= OUTBOX_CAPACITY:
            self.metrics.outbox_dropped.inc()
            log.warning("outbox full; dropping response", kind=msg.WhichOneof("payload"))
            return False
        self._outbox.append(msg)
        self._wake.set()
        return True

    # -- dispatch -------------------------------------------------------------------------------
    async def _node_state(self, u: shard_pb2.NodeStateUpdate) -> None:
        self.metrics.dispatch_inflight.inc()
        try:
            await self.handlers.node_state(u)
        finally:
            self.metrics.dispatch_inflight.dec()

    def _spawn(self, coro: Awaitable[None], what: str) -> None:
        async def guarded() -> None:
            async with self._sem:
                self.metrics.dispatch_inflight.inc()
                try:
                    await coro
                except Exception as exc:
                    log.warning("handler failed", handler=what, error=str(exc)[:300])
                finally:
                    self.metrics.dispatch_inflight.dec()

        t = asyncio.create_task(guarded())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def dispatch(self, msg: shard_pb2.ShardMessage) -> None:
        kind = msg.WhichOneof("payload")
        if kind == "ack":
            self.last_ack = msg.ack
            if msg.ack.echo == "hello":
                self.backoff.reset()
            elif (msg.ack.echo == "rollup" or msg.ack.echo.startswith("rollup-held")) and \
                    (acked := getattr(self.handlers, "rollup_ack", None)) is not None:
                # accepted, or held by the shard's empty-roll-up guard (ack.rollup_held, then a
                # "rollup-held: ..." echo)
                acked(msg.ack)
        elif kind == "bootstrap_request":
            resp = self.handlers.bootstrap(msg.bootstrap_request)
            self.send_response(shard_pb2.OperatorMessage(bootstrap_response=resp))
        elif kind == "node_state_update":
            self.coalescer.offer(msg.node_state_update)
        elif kind == "available_capacity":
            self._spawn(self.handlers.available_capacity(msg.available_capacity), "available_capacity")
        elif kind == "reclaim_instruction":
            self._spawn(self.handlers.reclaim(msg.reclaim_instruction, self._send_reclaim_ack), "reclaim")
        elif kind == "need_verdicts":
            # (newest wins: the handler only keeps the frame and wakes its own writer)
            if (verdicts := getattr(self.handlers, "need_verdicts", None)) is not None:
                verdicts(msg.need_verdicts)
        else:
            log.warning("unknown shard frame ignored", kind=kind)

    def _send_reclaim_ack(self, ack: shard_pb2.ReclaimAck) -> None:
        self.send_response(shard_pb2.OperatorMessage(reclaim_ack=ack))

    # -- one connection -------------------------------------------------------------------------
    async def _send_loop(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._outbox:
                await call.write(self._outbox.popleft())
            if self._rollup is not None:
                msg, self._rollup = self._rollup, None
                await call.write(shard_pb2.OperatorMessage(rollup=msg))
                self.rollups_sent += 1
                self.metrics.rollups_sent.inc()

    async def _recv_loop(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                raise SessionEnded("shard closed the stream")
            self.dispatch(msg)

    async def _rollup_loop(self) -> None:
        while True:
            try:
                await self.request_rollup()
            except Exception as exc:
                log.warning("roll-up failed", error=str(exc)[:300])
            await asyncio.sleep(self.rollup_interval)

    async def _session(self, target: str) -> None:
        async with dial(target, self.tls) as channel:
            stub = shard_pb2_grpc.ShardStub(channel)
            call = stub.Session()
            try:
                await call.write(shard_pb2.OperatorMessage(
                    hello=shard_pb2.Hello(cluster_id=self.cluster_id, protocol_version=PROTOCOL_VERSION)))
                # Nothing more is written until the shard answers the Hello: a refusal (a follower's
                # redirect, a wrong shard, a handoff) then reaches us whole, where a write racing
                # it would end the call locally as INTERNAL and lose the redirect trailer.
                first = await call.read()
                if first is grpc.aio.EOF:
                    raise SessionEnded("shard closed the stream before answering Hello")
                self._outbox.clear()  # answers meant for an earlier session are stale
                self._rollup = None
                self.sessions += 1
                self.target = target
                self.connected.set()
                self.metrics.session_connected.set(1)
                log.info("session open", shard=target, cluster=self.cluster_id)
                self.dispatch(first)
                tasks = [asyncio.create_task(self._send_loop(call)), asyncio.create_task(self._recv_loop(call)),
                         asyncio.create_task(self._rollup_loop())]
                try:
                    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                    if tasks[0] in done and tasks[1] not in done:
                        # A write racing the shard's close of a live session (a leader stepping
                        # down) fails locally without the trailers; the reader is about to see
                        # the real status and its redirect.
                        more, _ = await asyncio.wait([tasks[1]], timeout=1.0)
                        done |= more
                finally:
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                # The receiver's error carries the shard's status and trailers: prefer it.
                for t in sorted(done, key=lambda t: t is not tasks[1]):
                    exc = t.exception()
                    if exc is not None:
                        raise exc
            finally:
                self.connected.clear()
                self.metrics.session_connected.set(0)
                call.cancel()
                with contextlib.suppress(Exception):
                    await self._check_redirect(call)

    async def _check_redirect(self, call: grpc.aio.StreamStreamCall) -> None:
        md = await asyncio.wait_for(call.trailing_metadata(), timeout=3.0)
        for k, v in md or ():
            if k == REDIRECT_METADATA_KEY and v:
                self._redirect_to = str(v)

    # -- forever --------------------------------------------------------------------------------
    async def run(self) -> None:
        """Keep one session open until cancelled."""
        while True:
            self._redirect_to = None
            opened, status_lost, dropped = self.sessions, False, False
            target: str | None = None
            try:
                target = await self.resolver.resolve()
                await self._session(target)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                log.warning("session ended", code=exc.code().name, details=(exc.details() or "")[:200])
                for k, v in exc.trailing_metadata() or ():
                    if k == REDIRECT_METADATA_KEY and v:
                        self._redirect_to = str(v)
                status_lost = exc.code() == grpc.StatusCode.INTERNAL
                dropped = exc.code() == grpc.StatusCode.UNAVAILABLE
            except Exception as exc:
                log.warning("session ended", error=f"{type(exc).__name__}: {exc}"[:300])
            self.metrics.reconnects.inc()
            # Compared with this attempt's address, not the last session's: after a fallback the
            # configured address may rightly send us back to a leader we had a session on before.
            if self._redirect_to and self._redirect_to != target:
                log.info("following redirect", target=self._redirect_to)
                self.resolver.redirect(self._redirect_to)
                continue
            if status_lost and self.sessions > opened and self.target:
                # An open session ended locally (grpc-aio reports INTERNAL when a write races the
                # shard closing the stream, and the shard's status and redirect are lost). Ask
                # again at once: a shard that stepped down refuses the Hello, and that refusal,
                # written before anything else, arrives whole with its redirect.
                log.info("session ended without the shard's status; reconnecting at once", target=self.target)
                self.resolver.redirect(self.target)
                await asyncio.sleep(0.1)
                continue
            # A session that never opened, or an open one the transport dropped without a redirect
            # (the keepalive gave up on a frozen leader, the connection reset), says nothing about
            # who leads now: redialling a frozen leader would cost a whole connect timeout, asking
            # the configured address costs one redirect.
            if target is not None and (self.sessions == opened or dropped):
                self.resolver.failed(target)
            await asyncio.sleep(self.backoff.next())

    async def drain_handlers(self) -> None:
        """Wait for in-flight handlers (tests and shutdown)."""
        await self.coalescer.idle()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
