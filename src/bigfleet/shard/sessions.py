"""The ``Shard.Session`` server: one live stream per cluster.

Each session has a reader (the handler's own task), a writer task draining
the session's :class:`Outbox`, and a roll-up worker fed through a one-slot
queue (roll-ups are full replacements, so only the newest matters). A newer
session for the same cluster replaces the older one, which is closed with an
explicit status. Shutdown is explicit too: every stream ends with UNAVAILABLE
and a message telling the operator to reconnect, instead of relying on EOF
(a client cancel and a clean half-close look the same on the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass

import grpc

from bigfleet.needs.errors import ValidationError
from bigfleet.observability import get_logger
from bigfleet.security.limits import LimitExceeded, check_bootstrap_response
from bigfleet.security.roles import StreamEnded, session_denial
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.outbox import Outbox, OutboxOverflow
from bigfleet.v1alpha1 import capacity_pb2, shard_pb2, shard_pb2_grpc
from bigfleet.wire.needs import validate_cluster_id

# Trailer on an UNAVAILABLE that means "this shard will serve you shortly; retry" (same key the coordinator uses).
RETRY_LATER_KEY = "bigfleet-retry-later"

log = get_logger("bigfleet.shard.sessions")

PROTOCOL_VERSION = "v1alpha1"
#: Hello versions a session is opened for; an empty one (a client that leaves the field unset) is
#: taken as this one. Anything else is another wire contract and is refused at Hello.
SUPPORTED_PROTOCOLS = frozenset({"", PROTOCOL_VERSION})


def _stream_ended(reader: asyncio.Task[None]) -> StreamEnded | None:
    """Why a finished reader stopped, when the stream guard stopped it (not the operator)."""
    if not reader.done() or reader.cancelled():
        return None
    exc = reader.exception()
    return exc if isinstance(exc, StreamEnded) else None


@dataclass(frozen=True)
class RollupOutcome:
    """What the roll-up handler decided; ``error`` set means rejected (no ack)."""

    accepted: bool
    error: str = ""
    quarantined: bool = False


RollupHandler = Callable[[str, capacity_pb2.ClusterCapacityNeeds], Awaitable[RollupOutcome]]


@dataclass(frozen=True)
class BootstrapResult:
    user_data: bytes
    ttl_seconds: int
    error: str


#: the ack echo that follows the "rollup" ack of a roll-up the empty-roll-up guard held
HELD_ECHO = "rollup-held: a collapse of this cluster's demand is held by the empty-roll-up guard until restated"


class BootstrapUnavailable(Exception):
    """No session, the session went away, or the operator did not answer in time."""


class ReclaimSent:
    """A ReclaimInstruction handed to a session.

    ``delivered`` resolves once the frame was written to the operator's stream (it is cancelled
    when the session closed, or the frame was withdrawn, before that); ``acked`` resolves with the
    operator's ``nodes_started`` (cancelled when the session closed first). An ack also counts as
    delivery.
    """

    __slots__ = ("acked", "delivered", "instruction_id", "msg", "withdrawn", "writing")

    def __init__(self, instruction_id: str, msg: shard_pb2.ShardMessage, delivered: asyncio.Future[None],
                 acked: asyncio.Future[int]) -> None:
        self.instruction_id = instruction_id
        self.msg = msg
        self.delivered = delivered
        self.acked = acked
        self.writing = False
        self.withdrawn = False

    @property
    def was_delivered(self) -> bool:
        return (self.delivered.done() and not self.delivered.cancelled()) or self.was_acked

    @property
    def was_acked(self) -> bool:
        return self.acked.done() and not self.acked.cancelled()

    def withdraw(self) -> bool:
        """Take back an instruction not written yet (its frame is then skipped); False if it was
        delivered or is being written right now."""
        if self.was_delivered or self.writing:
            return False
        self.withdrawn = True
        if not self.delivered.done():
            self.delivered.cancel()
        if not self.acked.done():
            self.acked.cancel()
        return True


class OperatorSession:
    def __init__(self, cluster_id: str, context: grpc.aio.ServicerContext, max_unkeyed: int) -> None:
        self.cluster_id = cluster_id
        self.context = context
        self.outbox = Outbox(max_unkeyed=max_unkeyed)
        self.id = secrets.token_hex(4)
        self.closed = asyncio.Event()
        self.close_code = grpc.StatusCode.UNAVAILABLE
        self.close_reason = ""
        # Trailing metadata sent with a non-OK close (a handoff's ``bigfleet-redirect``).
        self.close_metadata: tuple[tuple[str, str], ...] = ()
        self._bootstrap_waiters: dict[str, asyncio.Future[BootstrapResult]] = {}
        self._reclaim_waiters: dict[str, asyncio.Future[int]] = {}
        # id(frame) -> reclaim instruction whose frame is not written yet (the writer reports delivery).
        self._unwritten: dict[int, ReclaimSent] = {}
        self.pending_rollup: capacity_pb2.ClusterCapacityNeeds | None = None
        self.pending_read_at = 0.0
        self.rollup_ready = asyncio.Event()
        # id(ack frame) -> when its roll-up was read; the writer observes read -> written.
        self.ack_read_at: dict[int, float] = {}

    def send(self, msg: shard_pb2.ShardMessage) -> bool:
        """Queue a frame; False (and the session closes) if its outbox overflowed."""
        if self.closed.is_set():
            return False
        try:
            self.outbox.put(msg)
            return True
        except OutboxOverflow as exc:
            self.close(grpc.StatusCode.RESOURCE_EXHAUSTED, f"outbox overflow ({exc}); reconnect for a resync")
            return False

    def close(self, code: grpc.StatusCode, reason: str) -> None:
        if self.closed.is_set():
            return
        self.close_code, self.close_reason = code, reason
        self.closed.set()
        self.outbox.close()
        for fut in self._bootstrap_waiters.values():
            if not fut.done():
                fut.set_exception(BootstrapUnavailable(f"session closed: {reason}"))
        for rfut in list(self._reclaim_waiters.values()):
            if not rfut.done():
                rfut.cancel()
        for sent in list(self._unwritten.values()):
            if not sent.delivered.done():
                sent.delivered.cancel()
        self._unwritten.clear()

    async def request_bootstrap(
        self, requirements: list[capacity_pb2.NodeSelectorRequirement], timeout: float
    ) -> BootstrapResult:
        request_id = secrets.token_hex(8)
        fut: asyncio.Future[BootstrapResult] = asyncio.get_running_loop().create_future()
        self._bootstrap_waiters[request_id] = fut
        try:
            msg = shard_pb2.ShardMessage(
                bootstrap_request=shard_pb2.BootstrapRequest(
                    request_id=request_id, requirements=requirements, cluster_id=self.cluster_id
                )
            )
            if not self.send(msg):
                raise BootstrapUnavailable("session closed")
            try:
                return await asyncio.wait_for(asyncio.shield(fut), timeout)
            except TimeoutError:
                raise BootstrapUnavailable(f"no bootstrap response within {timeout:g}s") from None
        finally:
            self._bootstrap_waiters.pop(request_id, None)

    def send_reclaim(self, nodes: list[str], grace_seconds: int, preemptor_priority: int) -> asyncio.Future[int]:
        """Send a ReclaimInstruction; the future resolves with ``nodes_started`` when acked."""
        return self.reclaim(nodes, grace_seconds, preemptor_priority).acked

    def reclaim(self, nodes: list[str], grace_seconds: int, preemptor_priority: int) -> ReclaimSent:
        """Send a ReclaimInstruction and track both its delivery (the frame written to the stream)
        and its ack. If the session is closed or its outbox overflows, both futures come back
        cancelled: the operator never got it."""
        instruction_id = secrets.token_hex(8)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        delivered: asyncio.Future[None] = loop.create_future()
        msg = shard_pb2.ShardMessage(
            reclaim_instruction=shard_pb2.ReclaimInstruction(
                instruction_id=instruction_id, nodes=nodes, grace_period_seconds=grace_seconds,
                preemptor_priority=preemptor_priority,
            )
        )
        sent = ReclaimSent(instruction_id, msg, delivered, fut)
        key = id(msg)
        self._reclaim_waiters[instruction_id] = fut

        def acked_done(_f: asyncio.Future[int]) -> None:
            self._reclaim_waiters.pop(instruction_id, None)
            if self._unwritten.get(key) is sent and sent.was_acked:
                del self._unwritten[key]  # (an ack proves delivery; nothing to wait for)

        def delivered_done(_f: asyncio.Future[None]) -> None:
            if self._unwritten.get(key) is sent and not sent.withdrawn:
                del self._unwritten[key]

        fut.add_done_callback(acked_done)
        delivered.add_done_callback(delivered_done)
        self._unwritten[key] = sent
        if not self.send(msg):
            self._unwritten.pop(key, None)
            for f in (delivered, fut):
                if not f.done():
                    f.cancel()
        return sent

    @property
    def reclaims_unwritten(self) -> bool:
        """Reclaim instructions queued and not written yet (the writer then checks each frame)."""
        return bool(self._unwritten)

    def before_write(self, msg: shard_pb2.ShardMessage) -> bool:
        """Called by the writer before each frame when reclaims are pending; False: skip the frame
        (a withdrawn reclaim instruction)."""
        sent = self._unwritten.get(id(msg))
        if sent is None or sent.msg is not msg:
            return True
        if sent.withdrawn:
            del self._unwritten[id(msg)]
            return False
        sent.writing = True
        return True

    def after_write(self, msg: shard_pb2.ShardMessage) -> None:
        """The writer wrote ``msg`` to the stream: a reclaim instruction counts as delivered."""
        sent = self._unwritten.get(id(msg))
        if sent is not None and sent.msg is msg:
            del self._unwritten[id(msg)]
            sent.writing = False
            if not sent.delivered.done():
                sent.delivered.set_result(None)

    def deliver_bootstrap(self, resp: shard_pb2.BootstrapBlobResponse) -> None:
        fut = self._bootstrap_waiters.get(resp.request_id)
        if fut is not None and not fut.done():
            try:
                check_bootstrap_response(resp)
            except LimitExceeded as exc:  # never forward an oversized blob to a provider
                fut.set_result(BootstrapResult(b"", 0, f"bootstrap response refused: {exc}"))
                return
            fut.set_result(BootstrapResult(bytes(resp.user_data), int(resp.ttl_seconds), resp.error))

    def deliver_reclaim_ack(self, ack: shard_pb2.ReclaimAck) -> None:
        fut = self._reclaim_waiters.get(ack.instruction_id)
        if fut is not None and not fut.done():
            fut.set_result(int(ack.nodes_started))


class SessionRegistry:
    """Live sessions by cluster; what the cycle and executor use to reach operators."""

    def __init__(self, metrics: ShardMetrics | None = None) -> None:
        self._by_cluster: dict[str, OperatorSession] = {}
        self._metrics = metrics
        self.metrics = metrics
        self.closed = False  # set by close_all: this term's daemon takes no more sessions
        self.on_removed: list[Callable[[str], None]] = []
        #: bumped whenever a session is installed or removed (lets per-cycle passes skip when idle)
        self.version = 0
        self._arrived = asyncio.Event()  # set (and replaced) on every install: wakes `connected`

    def get(self, cluster_id: str) -> OperatorSession | None:
        return self._by_cluster.get(cluster_id)

    def clusters(self) -> list[str]:
        return list(self._by_cluster)

    def __len__(self) -> int:
        return len(self._by_cluster)

    def install(self, session: OperatorSession) -> None:
        old = self._by_cluster.get(session.cluster_id)
        self._by_cluster[session.cluster_id] = session
        self.version += 1
        self._arrived.set()
        self._arrived = asyncio.Event()
        if old is not None:
            old.close(grpc.StatusCode.ABORTED, "replaced by a newer session for this cluster")
        if self._metrics:
            self._metrics.session_lifecycle.labels("replaced" if old else "installed").inc()
            self._metrics.active_sessions.set(len(self._by_cluster))

    async def connected(self, clusters: Collection[str], timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until every one of `clusters` has a session; whether they do."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while any(self.get(c) is None for c in clusters):
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return False
        return True

    def remove(self, session: OperatorSession) -> None:
        if self._by_cluster.get(session.cluster_id) is session:
            del self._by_cluster[session.cluster_id]
            self.version += 1
            for cb in self.on_removed:
                cb(session.cluster_id)
        if self._metrics:
            self._metrics.session_lifecycle.labels("removed").inc()
            self._metrics.active_sessions.set(len(self._by_cluster))

    def send(self, cluster_id: str, msg: shard_pb2.ShardMessage) -> bool:
        s = self._by_cluster.get(cluster_id)
        return s.send(msg) if s is not None else False

    def close_all(self, code: grpc.StatusCode, reason: str) -> None:
        """End every session; sessions opened after this are refused (``closed``)."""
        self.closed = True
        for s in list(self._by_cluster.values()):
            s.close(code, reason)


class SessionServicer(shard_pb2_grpc.ShardServicer):
    def __init__(
        self,
        registry: SessionRegistry,
        on_rollup: RollupHandler,
        ack_info: Callable[[], tuple[int, int]],
        resync: Callable[[OperatorSession], None],
        max_unkeyed: int = 4096,
        refuse_cluster: Callable[[str], Awaitable[tuple[str, str] | None]] | None = None,
        hold_cluster: Callable[[str], Awaitable[str | None]] | None = None,
        on_registration_timeout: Callable[[str, shard_pb2.NodeRegistrationTimeout], object] | None = None,
    ) -> None:
        self.registry = registry
        self._on_rollup = on_rollup
        self._ack_info = ack_info
        self._resync = resync
        self._max_unkeyed = max_unkeyed
        self.shutting_down = False
        # (reason, redirect address) when this shard must not serve a cluster (handed off); see handoff.py.
        self.refuse_cluster = refuse_cluster
        # A reason to answer UNAVAILABLE (retry later) for a cluster not yet ours to serve: one still being
        # handed to this shard (handoff.py). May wait a little for the adoption before answering.
        self.hold_cluster = hold_cluster
        # Operator reports of a Configured machine whose Node never registered (verdicts.py).
        self.on_registration_timeout = on_registration_timeout

    def _ack(self, echo: str) -> shard_pb2.ShardMessage:
        term, epoch = self._ack_info()
        return shard_pb2.ShardMessage(ack=shard_pb2.Acknowledgement(echo=echo, coordinator_term=term, shard_epoch=epoch))

    async def Session(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:  # type: ignore[override]
        if self.shutting_down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "shard shutting down; reconnect")
        try:
            first = await context.read()
        except StreamEnded:
            raise  # the stream guard's own status (e.g. RESOURCE_EXHAUSTED for an over-long Hello)
        except Exception as exc:  # a broken first read is the operator's fault, not ours
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"receive failed: {exc}")
        if (
            first is grpc.aio.EOF
            or not isinstance(first, shard_pb2.OperatorMessage)
            or first.WhichOneof("payload") != "hello"
            or not first.hello.cluster_id
        ):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first frame must be Hello with cluster_id")
        cluster_id = first.hello.cluster_id
        if first.hello.protocol_version not in SUPPORTED_PROTOCOLS:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"unsupported protocol_version {first.hello.protocol_version[:64]!r}; "
                                f"this shard speaks {PROTOCOL_VERSION!r}")
        try:  # (the id every roll-up of this session must carry: one that could never be accepted is refused now)
            validate_cluster_id(cluster_id, "hello.cluster_id")
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        denial = session_denial(context, cluster_id)  # None on plaintext (checks skipped)
        if denial:
            if self.registry.metrics:
                self.registry.metrics.identity_rejected.inc()
            log.warning("session identity rejected", cluster=cluster_id, reason=denial)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, denial)
        refused = await self.refuse_cluster(cluster_id) if self.refuse_cluster is not None else None
        if refused is not None:
            reason, addr = refused
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason,
                                trailing_metadata=(("bigfleet-redirect", addr),) if addr else ())
        held = await self.hold_cluster(cluster_id) if self.hold_cluster is not None else None
        if held is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, held, trailing_metadata=((RETRY_LATER_KEY, "handoff"),))
        if self.shutting_down or self.registry.closed:
            # Checked again after the awaits above: a step-down (or shutdown) that closed every
            # session meanwhile must not get one more installed on a daemon that no longer runs.
            await context.abort(grpc.StatusCode.UNAVAILABLE, "shard shutting down; reconnect")
        session = OperatorSession(cluster_id, context, self._max_unkeyed)
        slog = log.bind(cluster=cluster_id, session=session.id)
        self.registry.install(session)
        slog.info("session installed", protocol_version=first.hello.protocol_version)
        session.send(self._ack("hello"))
        self._resync(session)

        writer = asyncio.create_task(self._writer(session), name=f"session-writer-{cluster_id}")
        worker = asyncio.create_task(self._rollup_worker(session), name=f"session-rollups-{cluster_id}")
        reader = asyncio.create_task(self._reader(session), name=f"session-reader-{cluster_id}")
        closed_wait = asyncio.create_task(session.closed.wait())
        try:
            await asyncio.wait({reader, closed_wait, writer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended_by_peer = reader.done() and not session.closed.is_set()
            for t in (reader, worker, closed_wait):
                t.cancel()
            ended = _stream_ended(reader)
            if ended_by_peer and ended is not None:  # the stream guard ended it (e.g. an oversize frame)
                session.close(ended.code, ended.details)
            elif ended_by_peer:
                session.close(grpc.StatusCode.OK, "operator ended the stream")
            elif not session.closed.is_set():
                # (e.g. a failed write): whoever waits on this session's frames learns it is gone
                session.close(grpc.StatusCode.UNAVAILABLE, "session stream ended")
            # Flush whatever is already queued (e.g. a final status-relevant frame) before closing.
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(writer, 2.0)
            writer.cancel()
            self.registry.remove(session)
            slog.info("session removed", reason=session.close_reason)
        if session.close_code != grpc.StatusCode.OK:
            await context.abort(session.close_code, session.close_reason, trailing_metadata=session.close_metadata)

    async def _reader(self, session: OperatorSession) -> None:
        ctx = session.context
        while True:
            msg = await ctx.read()
            if msg is grpc.aio.EOF:
                return
            kind = msg.WhichOneof("payload")
            if kind == "rollup":
                if session.pending_rollup is None:
                    session.pending_read_at = time.perf_counter()
                session.pending_rollup = msg.rollup
                session.rollup_ready.set()
            elif kind == "bootstrap_response":
                session.deliver_bootstrap(msg.bootstrap_response)
            elif kind == "reclaim_ack":
                session.deliver_reclaim_ack(msg.reclaim_ack)
            elif kind == "registration_timeout":
                if self.on_registration_timeout is not None:
                    self.on_registration_timeout(session.cluster_id, msg.registration_timeout)
            elif kind == "hello":
                # (legal mid-stream, but it cannot move the session to another cluster: say so
                # instead of acking a switch that did not happen)
                if msg.hello.cluster_id and msg.hello.cluster_id != session.cluster_id:
                    session.send(self._ack(f"hello-rejected: this session is for cluster {session.cluster_id[:128]!r}; "
                                           "open a new session for another cluster"))
                else:  # (as after the first Hello: the machines' states and the verdicts again)
                    session.send(self._ack("hello"))
                    self._resync(session)

    async def _rollup_worker(self, session: OperatorSession) -> None:
        while True:
            await session.rollup_ready.wait()
            session.rollup_ready.clear()
            pb = session.pending_rollup
            read_at = session.pending_read_at
            session.pending_rollup = None
            if pb is None:
                continue
            if pb.cluster_id and pb.cluster_id != session.cluster_id:
                log.warning("roll-up for another cluster rejected", cluster=session.cluster_id, claimed=pb.cluster_id)
                if self.registry.metrics:
                    self.registry.metrics.rollups_rejected.labels(session.cluster_id).inc()
                session.send(self._ack(f"rollup-rejected: cluster_id: {pb.cluster_id[:128]!r} is not this session's cluster"))
                continue
            try:
                outcome = await self._on_rollup(session.cluster_id, pb)
            except Exception:
                log.exception("roll-up handler failed", cluster=session.cluster_id)
                continue
            if outcome.accepted or outcome.quarantined:
                ack = self._ack("rollup")
                # (a held roll-up: the operator raises its RollupHeld Event from this flag)
                ack.ack.rollup_held = outcome.quarantined and not outcome.accepted
                if session.send(ack) and self.registry.metrics:
                    session.ack_read_at[id(ack)] = read_at
                if outcome.quarantined:
                    # (after the "rollup" ack, which operators already expect: this one says why the
                    # demand did not change; the operator raises a RollupHeld Event on it)
                    session.send(self._ack(HELD_ECHO))
            elif outcome.error:
                # No "rollup" ack for a rejected roll-up; the reason rides on an ack echo that
                # operators log (they never act on acks), so the error is visible on the stream.
                session.send(self._ack(f"rollup-rejected: {outcome.error}"[:1024]))

    async def _writer(self, session: OperatorSession) -> None:
        ctx = session.context
        outbox = session.outbox
        while True:
            f = outbox.pop_next()
            if f is None:
                if outbox.closed:
                    return
                await outbox.wait()
                continue
            if session.reclaims_unwritten:
                if not session.before_write(f):
                    continue
                await ctx.write(f)
                session.after_write(f)
            else:
                await ctx.write(f)
            if session.ack_read_at:
                read_at = session.ack_read_at.pop(id(f), None)
                if read_at is not None and self.registry.metrics:
                    self.registry.metrics.rollup_ack.observe(time.perf_counter() - read_at)
