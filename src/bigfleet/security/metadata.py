"""Request metadata limits for every gRPC server: at most 64 entries and 16 KiB per call.

:class:`MetadataLimitInterceptor` applies :func:`bigfleet.security.limits.check_metadata` to each
call's invocation metadata before any other interceptor or handler runs, and answers a call
over a bound with INVALID_ARGUMENT naming the bound. ``bigfleet.rpc.new_server`` installs it on
every server it builds; a server built another way adds it first in its interceptor list.

gRPC's own transport limit on header size (8 KiB soft — refused at random above it — and 16 KiB
hard, counting pseudo-headers and 32 bytes per entry) would otherwise answer first, with
RESOURCE_EXHAUSTED; ``bigfleet.rpc.server_options`` raises it to :data:`TRANSPORT_METADATA_BYTES`
so that the documented bound is the one callers meet.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from bigfleet.observability import get_logger
from bigfleet.security.limits import DEFAULT_LIMITS, LimitExceeded, Limits, check_metadata

log = get_logger("bigfleet.security.metadata")

#: gRPC's header-list limit on our servers: the 16 KiB of keys and values we admit, plus room for
#: 64 entries' HTTP/2 overhead and the pseudo-headers; anything larger never reaches Python.
TRANSPORT_METADATA_BYTES = 32 << 10


def _refusal(handler: grpc.RpcMethodHandler, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with INVALID_ARGUMENT."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, details)

    ser = handler.response_serializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, response_serializer=ser)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, response_serializer=ser)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, response_serializer=ser)
    return grpc.stream_stream_rpc_method_handler(refuse, response_serializer=ser)


class MetadataLimitInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuse calls whose invocation metadata is over ``limits`` (64 entries / 16 KiB by default)
    with INVALID_ARGUMENT, before the handler (and the interceptors after this one) run."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self._limits = limits

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        try:
            check_metadata(handler_call_details.invocation_metadata, self._limits)
        except LimitExceeded as exc:
            handler = await continuation(handler_call_details)
            if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED as usual
                return None
            method = handler_call_details.method
            log.warning("request_metadata_over_limit", method=method, error=exc.message)
            return _refusal(handler, f"request metadata over the limit: {exc.message} "
                                     f"(limits: {self._limits.max_metadata_entries} entries, "
                                     f"{self._limits.max_metadata_bytes} bytes of keys and values)")
        return await continuation(handler_call_details)
