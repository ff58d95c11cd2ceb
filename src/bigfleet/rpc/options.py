"""Channel and server options every BigFleet gRPC endpoint uses.

A full-replacement roll-up can be large; the default 4 MiB receive limit
would answer RESOURCE_EXHAUSTED and make the operator reconnect in a loop, so
both directions are raised to 256 MiB on every server and client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

MAX_MESSAGE_BYTES = 256 << 20

_SIZE_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


# Clients ping every 20 s to keep long-lived streams (Session) alive through idle periods.
# Servers must accept pings at least that often, with or without calls in flight,
# or they answer GOAWAY "too_many_pings" and drop the idle streams.
_SERVER_KEEPALIVE: list[tuple[str, Any]] = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
]


# Request metadata is bounded by MetadataLimitInterceptor (64 entries / 16 KiB, INVALID_ARGUMENT).
# gRPC's own header limits (8 KiB soft: refused at random above it; 16 KiB hard, pseudo-headers
# and per-entry overhead included) would answer first with RESOURCE_EXHAUSTED, so they are set
# above that bound; a header list over this never reaches Python.
_METADATA_TRANSPORT_BYTES = 32 << 10  # = bigfleet.security.metadata.TRANSPORT_METADATA_BYTES
_SERVER_METADATA: list[tuple[str, Any]] = [
    ("grpc.max_metadata_size", _METADATA_TRANSPORT_BYTES),
    ("grpc.absolute_max_metadata_size", _METADATA_TRANSPORT_BYTES),
]


def server_options(extra: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    return [*_SIZE_OPTIONS, ("grpc.so_reuseport", 0), *_SERVER_KEEPALIVE, *_SERVER_METADATA, *extra]


# Clients ping every 20 s and give up on a peer that has not answered a ping within 10 s, so a
# frozen peer (SIGSTOP, a hung host, a silent partition) ends a stream within about 30 s. gRPC
# (1.85) times pings out after ``grpc.http2.ping_timeout_ms`` (60 s by default) whatever
# ``grpc.keepalive_timeout_ms`` says, so both are set: with the default an operator kept
# streaming into a SIGSTOPped shard leader for 80 s while its successor had no session for the
# cluster (tests/operator/test_operator_frozen_shard.py).
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000


def channel_options(extra: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
    return [
        *_SIZE_OPTIONS,
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        *extra,
    ]


def without_keepalive(options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``options`` without the client keepalive (pings and their timeout), for channels that must not ping."""
    return [o for o in options if not o[0].startswith("grpc.keepalive") and o[0] != "grpc.http2.ping_timeout_ms"]


def insecure_channel(target: str, extra: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=channel_options(extra))


def new_server(
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    maximum_concurrent_rpcs: int | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """An asyncio gRPC server with BigFleet's limits and the standard health service registered.

    The request-metadata limit (`MetadataLimitInterceptor`) runs before ``interceptors``.
    """
    from bigfleet.security.metadata import MetadataLimitInterceptor  # (bigfleet.security imports this module)

    server = grpc.aio.server(
        options=server_options(),
        interceptors=[MetadataLimitInterceptor(), *interceptors],
        maximum_concurrent_rpcs=maximum_concurrent_rpcs,
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
