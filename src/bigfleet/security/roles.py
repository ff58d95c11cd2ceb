"""Who may call what: role policies, a server interceptor and in-handler checks.

The policy is data (method path → :class:`Access`) decided by the pure :func:`authorize`;
:class:`RoleInterceptor` applies it to every call of a grpc.aio server, and the
``require_*`` helpers serve checks that depend on something only the handler knows (the
cluster id in a Session's first frame). Every denial is PERMISSION_DENIED; over plaintext
every check passes (protocols.md §5.3, §8).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import CollectorRegistry, Counter

from bigfleet.observability import get_logger
from bigfleet.security.identity import Identity, IdentityError, Role, identity_from_auth_context
from bigfleet.security.limits import LimitExceeded, SessionThrottle, StreamLimit, Verdict
from bigfleet.v1alpha1 import provider_pb2

log = get_logger("bigfleet.security.roles")

MIN_TLS_VERSIONS = frozenset({"TLSv1.3"})


@dataclass(frozen=True)
class Access:
    """Roles allowed on a method; ``self_field`` pins the caller's id to a request field.

    With ``self_field`` set (unary-request methods only) a cluster/shard caller passes only
    when ``request.<self_field> == identity.id``; ``allow_empty_self`` lets an empty field
    through (the handler's own validation answers it).
    """

    roles: frozenset[Role]
    self_field: str = ""
    allow_empty_self: bool = False
    # For servers that hand handlers raw bytes (the provider kit decodes lazily): how to read
    # ``self_field`` from them. Without it such a request fails closed.
    parse: Callable[[bytes], Any] | None = None

    @classmethod
    def of(
        cls, *roles: Role, self_field: str = "", allow_empty_self: bool = False,
        parse: Callable[[bytes], Any] | None = None,
    ) -> Access:
        return cls(frozenset(roles), self_field, allow_empty_self, parse)


DENY = Access(frozenset())
ADMIN_ONLY = Access.of(Role.ADMIN)
READ = Access.of(Role.READONLY, Role.ADMIN)
ANY_IDENTITY = Access(frozenset(Role))


class PermissionDenied(Exception):
    """Raised by the pure checks; the shell turns it into PERMISSION_DENIED."""


def authorize(identity: Identity | None, access: Access, subject: str | None = None) -> None:
    """Pure decision. ``identity`` None = plaintext = allowed. Raises PermissionDenied."""
    if identity is None:
        return
    if identity.role not in access.roles:
        allowed = ", ".join(sorted(r.value for r in access.roles)) or "nobody"
        raise PermissionDenied(f"identity {identity.uri} may not call this method (allowed: {allowed})")
    if access.self_field and identity.role in (Role.CLUSTER, Role.SHARD):
        if subject is None or (not subject and access.allow_empty_self):
            return
        if subject != identity.id:
            raise PermissionDenied(
                f"identity {identity.uri} may not act for {identity.role.value} {subject!r}"
            )


def check_transport(auth: Mapping[str, Iterable[bytes]]) -> None:
    """Reject TLS sessions below 1.3 (grpcio cannot set a minimum version itself)."""
    versions = [v.decode(errors="replace") for v in auth.get("ssl_tls_version", [])]
    if versions and not MIN_TLS_VERSIONS.intersection(versions):
        raise PermissionDenied(f"TLS version {versions[0]} is below the required TLSv1.3")


def _service(method: str) -> str:
    return method.rsplit("/", 1)[0].lstrip("/")


_PKG = "bigfleet.v1alpha1"

COORDINATOR_POLICY: dict[str, Access] = {
    f"/{_PKG}.Coordinator/ReportShard": Access.of(Role.SHARD, self_field="shard_id", allow_empty_self=True),
    f"/{_PKG}.Coordinator/AssignDomain": ADMIN_ONLY,
    f"/{_PKG}.Coordinator/UnassignDomain": ADMIN_ONLY,
    f"/{_PKG}.Coordinator/RemoveShard": ADMIN_ONLY,
    f"/{_PKG}.Coordinator/JoinRaftCluster": ADMIN_ONLY,
    f"/{_PKG}.Coordinator/SnapshotSave": ADMIN_ONLY,
    f"/{_PKG}.Coordinator/ListShards": READ,
    f"/{_PKG}.Coordinator/ListDomainAssignments": READ,
    f"/{_PKG}.Coordinator/ListShardReports": READ,
    # Python additions (placement and rebalancing).
    f"/{_PKG}.Coordinator/LookupCluster": Access.of(
        Role.CLUSTER, Role.ADMIN, Role.READONLY, self_field="cluster_id", allow_empty_self=True
    ),
    f"/{_PKG}.Coordinator/ListClusterBindings": READ,
    f"/{_PKG}.Coordinator/PlanRebalance": READ,
    f"/{_PKG}.Coordinator/ApplyRebalance": ADMIN_ONLY,
    f"/{_PKG}.Coordinator/ListTransfers": READ,
    # A shard asks about a cluster whose operator says Hello (handoff window); no self check: the subject is a cluster.
    f"/{_PKG}.Coordinator/GetClusterStatus": Access.of(Role.SHARD, Role.ADMIN, Role.READONLY),
}

SHARD_POLICY: dict[str, Access] = {
    # The cluster id arrives in the first frame; the handler completes the check with
    # require_cluster(). Here only the role is checked, so other roles never get a stream.
    f"/{_PKG}.Shard/Session": Access.of(Role.CLUSTER),
    f"/{_PKG}.ShardRead/InspectNeeds": READ,
    f"/{_PKG}.ShardRead/GetInventoryCounts": READ,
    f"/{_PKG}.ShardRead/ListShortfalls": READ,
    # Python addition: an operator asks about its own cluster only (dry-run CapacityRequests).
    f"/{_PKG}.ShardRead/WhatIf": Access.of(Role.CLUSTER, Role.READONLY, Role.ADMIN, self_field="cluster_id"),
    f"/{_PKG}.ShardRead/PlanConsolidation": READ,
    f"/{_PKG}.ShardAdmin/GetActuation": READ,
    f"/{_PKG}.ShardAdmin/SetActuation": ADMIN_ONLY,
}

def _fenced(message: Any) -> Access:
    return Access.of(Role.SHARD, self_field="shard_id", allow_empty_self=True, parse=message.FromString)


PROVIDER_POLICY: dict[str, Access] = {
    # Mutations carry the fencing shard_id: a shard certificate may only act as itself.
    f"/{_PKG}.CapacityProvider/Create": _fenced(provider_pb2.CreateRequest),
    f"/{_PKG}.CapacityProvider/Configure": _fenced(provider_pb2.ConfigureRequest),
    f"/{_PKG}.CapacityProvider/Drain": _fenced(provider_pb2.DrainRequest),
    f"/{_PKG}.CapacityProvider/Delete": _fenced(provider_pb2.DeleteRequest),
    f"/{_PKG}.CapacityProvider/Get": Access.of(Role.SHARD, Role.ADMIN, Role.READONLY),
    f"/{_PKG}.CapacityProvider/List": Access.of(Role.SHARD, Role.ADMIN, Role.READONLY),
}

# Infrastructure services any verified identity may use.
OPEN_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"})


def lookup(policy: Mapping[str, Access], method: str, unlisted: Access = ADMIN_ONLY) -> Access:
    """The access rule for a method path; unknown BigFleet methods default to admin-only."""
    if method in policy:
        return policy[method]
    if _service(method) in OPEN_SERVICES:
        return ANY_IDENTITY
    return unlisted


class _Denials:
    def __init__(self, registry: CollectorRegistry | None, component: str) -> None:
        self.counter: Counter | None = None
        if registry is not None:
            self.counter = Counter(
                f"bigfleet_{component}_permission_denied_total",
                "Calls refused by the mTLS identity/role policy",
                ["method"],
                registry=registry,
            )

        self.throttled: Counter | None = None
        if registry is not None:
            self.throttled = Counter(
                f"bigfleet_{component}_stream_throttled_total",
                "Stream frames paced (defer) or streams ended (close) by the per-call rate limits",
                ["method", "action"],
                registry=registry,
            )

    def inc(self, method: str) -> None:
        if self.counter is not None:
            self.counter.labels(method=method).inc()

    def throttle(self, method: str, action: str) -> None:
        if self.throttled is not None:
            self.throttled.labels(method=method, action=action).inc()


async def _deny(context: grpc.aio.ServicerContext, method: str, reason: str, denials: _Denials) -> None:
    denials.inc(method)
    log.warning("permission_denied", method=method, reason=reason, peer=context.peer())
    await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)


_SELF_ROLES = (Role.CLUSTER, Role.SHARD)


def _subject(access: Access, request: Any) -> str:
    """The request's ``self_field``; fails closed when it cannot be read."""
    if isinstance(request, bytes | bytearray | memoryview):
        if access.parse is None:
            raise PermissionDenied(f"cannot check {access.self_field} on an undecoded request")
        try:
            request = access.parse(bytes(request))
        except Exception:
            return ""  # undecodable: the handler's own decoding answers INVALID_ARGUMENT
    if not hasattr(request, access.self_field):
        raise PermissionDenied(f"request carries no {access.self_field} to check")
    return str(getattr(request, access.self_field))


def _decide(context: grpc.aio.ServicerContext, access: Access, request: Any | None) -> str | None:
    """Returns a denial reason or None. Reads the peer, so it belongs to the shell."""
    try:
        auth = context.auth_context()
        check_transport(auth)
        identity = identity_from_auth_context(auth)
        subject = None
        if access.self_field and request is not None and identity is not None and identity.role in _SELF_ROLES:
            subject = _subject(access, request)
        authorize(identity, access, subject)
    except (IdentityError, PermissionDenied) as exc:
        return str(exc)
    return None


class RoleInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Applies a method policy to every call before the handler runs.

    Install it on plaintext servers too: identity checks pass there, but a request frame that
    fails protobuf decoding still ends its call with INVALID_ARGUMENT instead of reaching the
    handler as ``None``.

    ``stream_limits`` (method → :class:`~bigfleet.security.limits.StreamLimit`) rate-limits
    each call of those streaming methods on its own (one throttle per stream, so one flooding
    session never slows another).

    Pass ``registry`` to count denials as ``bigfleet_<component>_permission_denied_total`` and
    throttling as ``bigfleet_<component>_stream_throttled_total``.
    """

    def __init__(
        self,
        policy: Mapping[str, Access],
        *,
        unlisted: Access = ADMIN_ONLY,
        registry: CollectorRegistry | None = None,
        component: str = "security",
        stream_limits: Mapping[str, StreamLimit] | None = None,
    ) -> None:
        self._policy = dict(policy)
        self._unlisted = unlisted
        self._denials = _Denials(registry, component)
        self._limits = dict(stream_limits or {})

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        return _wrap(
            handler, method, lookup(self._policy, method, self._unlisted), self._denials, self._limits.get(method)
        )


MALFORMED = "malformed request frame (protobuf decoding failed)"
_BAD_FRAME = object()  # what the guarded deserializer returns instead of raising


def _guarded(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """Decode failures become a marker the wrapped behaviour answers with INVALID_ARGUMENT;
    left alone, gRPC answers UNKNOWN for a unary call and breaks a stream's reader."""
    if deserializer is None:
        return None
    des = deserializer

    def decode(raw: bytes) -> Any:
        try:
            return des(raw)
        except Exception:
            return _BAD_FRAME

    return decode


def _bad(msg: Any) -> bool:
    return msg is None or msg is _BAD_FRAME


class StreamEnded(Exception):
    """Raised out of a read to stop the handler; the wrapper then ends the call with ``status``.

    The status is sent from the handler's own task after it returns, never from the task that
    happened to read (a handler's reader task): an abort from a side task was seen to leave the
    client waiting until its deadline.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _StreamGuard:
    """One per streaming call: the hard frame bucket and the pacing of soft frames."""

    def __init__(self, limit: StreamLimit, method: str, counters: _Denials) -> None:
        self.limit = limit
        self.throttle = SessionThrottle(limit.config)
        self.method = method
        self.counters = counters

    async def admit(self, msg: Any, peer: str) -> StreamEnded | None:
        loop = asyncio.get_running_loop()
        try:
            self.limit.check(msg)
        except LimitExceeded as exc:
            self.counters.throttle(self.method, "oversize")
            log.warning("stream_closed_frame_over_limit", method=self.method, peer=peer, error=str(exc))
            return StreamEnded(grpc.StatusCode.RESOURCE_EXHAUSTED, f"frame over a size limit: {exc}")
        if self.throttle.on_frame(loop.time()) is Verdict.CLOSE:
            self.counters.throttle(self.method, "close")
            log.warning("stream_closed_over_frame_rate", method=self.method, peer=peer)
            return StreamEnded(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              "frame rate over the per-session limit; reconnect and slow down")
        if not self.limit.soft(msg) or self.throttle.on_rollup(loop.time()) is Verdict.ACCEPT:
            return None
        self.counters.throttle(self.method, "defer")
        while not self.throttle.rollups.try_take(loop.time()):
            await asyncio.sleep(self.throttle.rollups.wait_time(loop.time()))
        return None


class _StrictContext:
    """Delegates to the real servicer context; vets every inbound frame of a streaming call.

    A frame gRPC could not deserialize (grpc.aio raises DecodeError out of ``read()``, or hands
    the handler ``None``, which handlers mistake for end-of-stream or crash on) ends the call
    with INVALID_ARGUMENT; the stream limits end it with RESOURCE_EXHAUSTED. Either way the read
    raises :class:`StreamEnded` and :meth:`finish` sends the status once the handler is done.
    """

    def __init__(self, inner: grpc.aio.ServicerContext, guard: _StreamGuard | None = None) -> None:
        self._inner = inner
        self._guard = guard
        self.ending: StreamEnded | None = None
        self.write = inner.write  # (every outbound frame: bound once, not looked up through __getattr__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def vet(self, msg: Any) -> Any:
        if self.ending is not None:
            raise self.ending
        if _bad(msg):
            self.ending = StreamEnded(grpc.StatusCode.INVALID_ARGUMENT, MALFORMED)
            raise self.ending
        if self._guard is not None and msg is not grpc.aio.EOF:
            end = await self._guard.admit(msg, self._inner.peer())
            if end is not None:
                self.ending = end
                raise end
        return msg

    async def read(self) -> Any:
        try:
            msg = await self._inner.read()
        except DecodeError:
            msg = None
        return await self.vet(msg)

    async def finish(self) -> None:
        if self.ending is not None:
            await self._inner.abort(self.ending.code, self.ending.details)


async def _strict_iter(it: AsyncIterator[Any], strict: _StrictContext) -> AsyncIterator[Any]:
    while True:
        try:
            msg = await it.__anext__()
        except StopAsyncIteration:
            return
        except DecodeError:
            msg = None
        yield await strict.vet(msg)


async def _run_stream_handler(call: Awaitable[Any], strict: _StrictContext) -> Any:
    """Await the handler; if a frame was refused, end the call with that status afterwards."""
    try:
        result = await call
    except StreamEnded:
        result = None
    except grpc.aio.AbortError:
        raise  # the handler chose its own status
    except Exception:
        if strict.ending is None:
            raise
        result = None
    await strict.finish()
    return result


class _Gate:
    """What a wrapped handler checks before its servicer runs: a well-formed request and the caller's
    role; streams also get their strict context (message limits, clean endings)."""

    def __init__(self, method: str, access: Access, denials: _Denials, limit: StreamLimit | None) -> None:
        self.method, self.access, self.denials, self.limit = method, access, denials, limit

    async def request(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        if _bad(request):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, MALFORMED)
        await self.caller(context, request)

    async def caller(self, context: grpc.aio.ServicerContext, request: Any = None) -> None:
        reason = _decide(context, self.access, request)
        if reason is not None:
            await _deny(context, self.method, reason, self.denials)

    def strict(self, context: grpc.aio.ServicerContext) -> _StrictContext:
        guard = _StreamGuard(self.limit, self.method, self.denials) if self.limit is not None else None
        return _StrictContext(context, guard)


def _wrap(
    handler: grpc.RpcMethodHandler, method: str, access: Access, denials: _Denials, limit: StreamLimit | None = None
) -> grpc.RpcMethodHandler:
    gate = _Gate(method, access, denials, limit)
    des, ser = _guarded(handler.request_deserializer), handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(_unary_unary(handler.unary_unary, gate),
                                                   request_deserializer=des, response_serializer=ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(_unary_stream(handler.unary_stream, gate),
                                                    request_deserializer=des, response_serializer=ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(_stream_unary(handler.stream_unary, gate),
                                                    request_deserializer=des, response_serializer=ser)
    return grpc.stream_stream_rpc_method_handler(_stream_stream(handler.stream_stream, gate),
                                                 request_deserializer=des, response_serializer=ser)


def _unary_unary(inner: Any, gate: _Gate) -> Any:
    async def uu(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await gate.request(request, context)
        return await inner(request, context)

    return uu


def _unary_stream(inner: Any, gate: _Gate) -> Any:
    if inspect.isasyncgenfunction(inner):

        async def us_gen(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await gate.request(request, context)
            async for item in inner(request, context):
                yield item

        return us_gen

    async def us(request: Any, context: grpc.aio.ServicerContext) -> None:
        await gate.request(request, context)
        await inner(request, context)

    return us


def _stream_unary(inner: Any, gate: _Gate) -> Any:
    async def su(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        await gate.caller(context)
        strict = gate.strict(context)
        return await _run_stream_handler(inner(_strict_iter(request_iterator, strict), strict), strict)

    return su


def _stream_stream(inner: Any, gate: _Gate) -> Any:
    if inspect.isasyncgenfunction(inner):

        async def ss_gen(request_iterator: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await gate.caller(context)
            strict = gate.strict(context)
            try:
                async for item in inner(_strict_iter(request_iterator, strict), strict):
                    yield item
            except StreamEnded:
                pass
            except grpc.aio.AbortError:
                raise
            except Exception:
                if strict.ending is None:
                    raise
            await strict.finish()

        return ss_gen

    async def ss(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await gate.caller(context)
        strict = gate.strict(context)
        await _run_stream_handler(inner(_strict_iter(request_iterator, strict), strict), strict)

    return ss


async def require_role(context: grpc.aio.ServicerContext, *roles: Role) -> Identity | None:
    """In-handler check: abort with PERMISSION_DENIED unless the caller holds one of ``roles``."""
    reason = _decide(context, Access(frozenset(roles)), None)
    if reason is not None:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
    return _identity_or_none(context)


async def require_self(context: grpc.aio.ServicerContext, role: Role, subject_id: str) -> Identity | None:
    """Abort unless the caller is exactly ``bigfleet://<role>/<subject_id>`` (plaintext passes)."""
    reason = _decide(context, Access.of(role, self_field="x"), _Subject(subject_id))
    if reason is not None:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
    return _identity_or_none(context)


async def require_cluster(context: grpc.aio.ServicerContext, cluster_id: str) -> Identity | None:
    """The Session check: the certificate must name ``bigfleet://cluster/<cluster_id>``."""
    return await require_self(context, Role.CLUSTER, cluster_id)


async def require_shard(context: grpc.aio.ServicerContext, shard_id: str) -> Identity | None:
    """The ReportShard check: only ``bigfleet://shard/<shard_id>`` (admin does not pass)."""
    return await require_self(context, Role.SHARD, shard_id)


def session_denial(context: grpc.aio.ServicerContext, cluster_id: str) -> str | None:
    """Non-aborting twin of :func:`require_cluster` for handlers that count before aborting."""
    return _decide(context, Access.of(Role.CLUSTER, self_field="x"), _Subject(cluster_id))


@dataclass(frozen=True)
class _Subject:
    x: str


#: Set by a coordinator replica on a call it forwards to the leader: the role of the caller it
#: checked. The leader sees the replica's own (admin) certificate, so without it a forwarded
#: readonly call would act as admin.
CALLER_ROLE_METADATA_KEY = "bigfleet-caller-role"


def acting_role(direct: Identity | None, relayed: str | None) -> Role | None:
    """The role a call acts with (None over plaintext). Only an admin peer (a forwarding
    replica) may name its caller's role, and only to narrow its own; anyone else's claim is ignored."""
    if direct is None:
        return None
    if direct.role is Role.ADMIN and relayed:
        try:
            return Role(relayed)
        except ValueError:
            return Role.READONLY  # an unknown relayed role gets the least
    return direct.role


def caller_role(context: grpc.aio.ServicerContext) -> Role | None:
    """:func:`acting_role` of this call: the peer certificate and the relayed-role metadata."""
    relayed = next((str(v) for k, v in context.invocation_metadata() or () if k == CALLER_ROLE_METADATA_KEY), None)
    return acting_role(_identity_or_none(context), relayed)


def _identity_or_none(context: grpc.aio.ServicerContext) -> Identity | None:
    try:
        return identity_from_auth_context(context.auth_context())
    except IdentityError:
        return None
