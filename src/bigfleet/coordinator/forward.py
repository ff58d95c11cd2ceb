"""A follower coordinator forwards client RPCs to its leader (one hop), so any replica will do.

Clients reach the coordinator through a Service that lists every replica that sees a leader
(the Helm chart's), and an operator in another cluster cannot dial the leader hint a follower
would give (a pod name on the coordinator's internal headless Service). So a replica that is
not the ready leader forwards the call over gRPC to the leader it knows, and relays the leader's
answer: the response and trailing metadata on success, the status code, details and trailing
metadata on failure, all unchanged.

* **One hop.** A forwarded call carries :data:`FORWARDED_METADATA_KEY` (the forwarding
  replica's node id) and is never forwarded again: the replica it reaches serves it or refuses
  it (``not leader``, with its own leader hint), and that answer is relayed. Clients may set
  the key themselves (:data:`~bigfleet.coordclient.client.DIRECT_METADATA`) to ask one
  replica only, e.g. to probe which one leads.
* **Deadline.** The forwarded call's deadline is the caller's remaining time, capped at
  ``max_timeout`` (also the deadline when the caller set none). Cancelling the caller's call
  cancels the forwarded one.
* **Identity.** The forwarded call is made with this replica's own TLS identity and channel
  options (the ones it joins the Raft group with): the caller's identity was checked here, by
  the role interceptor that runs before this one, and the leader checks the replica's
  certificate (``bigfleet://admin``). The caller's role travels along
  (:data:`~bigfleet.security.roles.CALLER_ROLE_METADATA_KEY`), so a handler that treats roles
  differently (a readonly ``LookupCluster`` never binds) sees the caller's, not the replica's.
* **Leader not reached.** If the call fails UNAVAILABLE and the channel to the leader is not
  connected (refused, unresolvable, reset), the leader did not answer; the replica then
  answers as a follower always did, FAILED_PRECONDITION ``not leader; leader=HOST:PORT`` with
  the ``bigfleet-leader`` trailer, so clients' election retry and hint following still apply.
* **Not forwarded.** ``ReportShard``: the leader pins it to the reporting shard's own
  certificate (``bigfleet://shard/<id>``), which a forwarded call cannot present, and shards run
  beside the coordinator where the leader hint is dialable (their client follows it). Methods
  not listed in :data:`FORWARDED_METHODS` keep refusing with a hint.
* No leader known, or this replica is the leader but not ready yet (its barrier write): nothing
  to forward to; the handler refuses as before and clients retry.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
from prometheus_client import Counter

from bigfleet.coordclient.client import FORWARDED_METADATA_KEY, LEADER_METADATA_KEY
from bigfleet.observability import get_logger
from bigfleet.security.roles import CALLER_ROLE_METADATA_KEY, caller_role
from bigfleet.security.tls import RotatingChannel, TLSConfig
from bigfleet.v1alpha1 import coordinator_pb2_grpc as pbg

SERVICE_NAME = "bigfleet.v1alpha1.Coordinator"
NOT_LEADER_MESSAGE = "coordinator: not leader"
#: Every Coordinator RPC that needs the leader and may be forwarded to it (all but ReportShard).
FORWARDED_METHODS = frozenset(
    {
        # placement: binds an unbound cluster (a Raft write)
        "LookupCluster",
        # a shard's handoff-window check: must not see a follower's lagging state
        "GetClusterStatus",
        # reads bigfleetctl and the dashboard use; served from the leader's applied state
        # (a follower's may lag) and, for ListShardReports, its leader-local soft state
        "ListShards",
        "ListDomainAssignments",
        "ListShardReports",
        "ListClusterBindings",
        "ListTransfers",
        "PlanRebalance",
        # writes
        "AssignDomain",
        "UnassignDomain",
        "RemoveShard",
        "ApplyRebalance",
        "AbortTransfer",
        "JoinRaftCluster",
        # server-streaming: relayed frame by frame
        "SnapshotSave",
    }
)
DEFAULT_MAX_TIMEOUT = 30.0

log = get_logger("bigfleet.coordinator.forward")


def _relayable(md: Any) -> tuple[tuple[str, Any], ...]:
    """Trailing metadata worth passing on (gRPC's own ``grpc-*`` keys are the transport's)."""
    return tuple((k, v) for k, v in (md or ()) if not k.startswith("grpc-"))


def _is_forwarded(details: grpc.HandlerCallDetails) -> bool:
    return any(k == FORWARDED_METADATA_KEY for k, _ in (details.invocation_metadata or ()))


class LeaderForwarder(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Server interceptor: on a replica that is not the ready leader, forward to the leader.

    ``ready()`` is true on the leader once it may serve; ``leader_hint()`` is the leader's gRPC
    address ("" when unknown); ``self_address()`` is this replica's own (never forwarded to).
    Install it *after* the role interceptor, so the caller is checked here first.
    """

    def __init__(
        self,
        *,
        node_id: str,
        ready: Callable[[], bool],
        leader_hint: Callable[[], str],
        self_address: Callable[[], str],
        tls: TLSConfig | None = None,
        max_timeout: float = DEFAULT_MAX_TIMEOUT,
        counter: Counter | None = None,
    ) -> None:
        self.node_id = node_id
        self.ready = ready
        self.leader_hint = leader_hint
        self.self_address = self_address
        self.tls = tls
        self.max_timeout = max_timeout
        self.counter = counter
        self._channels: dict[str, RotatingChannel] = {}

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    # ------------------------------------------------------------ routing
    def target(self) -> str | None:
        """The leader to forward to now, or None to serve (or refuse) here."""
        if self.ready():
            return None
        hint = self.leader_hint()
        if not hint or hint == self.self_address():
            return None
        return hint

    def _channel(self, target: str) -> grpc.aio.Channel:
        ch = self._channels.get(target)
        if ch is None:
            ch = self._channels[target] = RotatingChannel(target, self.tls)
        return ch.get()

    def _metadata(self, context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
        """One-hop mark, and the checked caller's role: the leader sees this replica's admin
        certificate and must not let a readonly caller act as admin (LookupCluster binds)."""
        role = caller_role(context)
        if role is None:
            return ((FORWARDED_METADATA_KEY, self.node_id),)
        return ((FORWARDED_METADATA_KEY, self.node_id), (CALLER_ROLE_METADATA_KEY, role.value))

    def _timeout(self, context: grpc.aio.ServicerContext) -> float:
        remaining = context.time_remaining()
        return self.max_timeout if remaining is None else min(float(remaining), self.max_timeout)

    def _count(self, method: str, outcome: str) -> None:
        if self.counter is not None:
            self.counter.labels(method=method, outcome=outcome).inc()

    async def _relay_error(
        self, method: str, target: str, ch: grpc.aio.Channel, err: grpc.aio.AioRpcError,
        context: grpc.aio.ServicerContext, received: bool,
    ) -> NoReturn:
        code = err.code()
        if (
            code == grpc.StatusCode.UNAVAILABLE
            and not received
            and ch.get_state(try_to_connect=False) != grpc.ChannelConnectivity.READY
        ):
            # The leader never answered (refused, unresolvable, reset): answer as a follower
            # always has, so the client follows the hint or waits out an election.
            self._count(method, "leader_unreachable")
            log.info("forward to leader failed", method=method, leader=target, error=(err.details() or "")[:200])
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{NOT_LEADER_MESSAGE}; leader={target} (forwarding to it failed)",
                trailing_metadata=((LEADER_METADATA_KEY, target),),
            )
        self._count(method, code.name)
        await context.abort(code, err.details() or "", trailing_metadata=_relayable(err.trailing_metadata()))
        raise AssertionError("unreachable")

    async def forward_unary(self, method: str, target: str, request: Any, context: grpc.aio.ServicerContext) -> Any:
        ch = self._channel(target)
        call = getattr(pbg.CoordinatorStub(ch), method)(request, timeout=self._timeout(context), metadata=self._metadata(context))
        try:
            resp = await call
        except grpc.aio.AioRpcError as err:
            await self._relay_error(method, target, ch, err, context, received=False)
        trailing = _relayable(await call.trailing_metadata())
        if trailing:
            context.set_trailing_metadata(trailing)
        self._count(method, "OK")
        return resp

    async def forward_stream(
        self, method: str, target: str, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        ch = self._channel(target)
        remaining = context.time_remaining()  # a stream may run long: only the caller's deadline bounds it
        call = getattr(pbg.CoordinatorStub(ch), method)(request, timeout=remaining, metadata=self._metadata(context))
        received = False
        try:
            async for item in call:
                received = True
                yield item
        except grpc.aio.AioRpcError as err:
            await self._relay_error(method, target, ch, err, context, received=received)
        trailing = _relayable(await call.trailing_metadata())
        if trailing:
            context.set_trailing_metadata(trailing)
        self._count(method, "OK")

    # -------------------------------------------------------- interceptor
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        service, _, method = details.method.lstrip("/").rpartition("/")
        if handler is None or service != SERVICE_NAME or method not in FORWARDED_METHODS or _is_forwarded(details):
            return handler
        des, ser = handler.request_deserializer, handler.response_serializer

        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def uu(request: Any, context: grpc.aio.ServicerContext) -> Any:
                target = self.target()
                if target is None:
                    return await inner_uu(request, context)
                return await self.forward_unary(method, target, request, context)

            return grpc.unary_unary_rpc_method_handler(uu, request_deserializer=des, response_serializer=ser)

        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            inner_us = handler.unary_stream

            async def us(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                target = self.target()
                source = inner_us(request, context) if target is None else self.forward_stream(method, target, request, context)
                async for item in source:
                    yield item

            return grpc.unary_stream_rpc_method_handler(us, request_deserializer=des, response_serializer=ser)

        return handler
