"""A frozen shard (SIGSTOP, a hung host, a silent partition) must end the operator's Session within the
keepalive the channel options promise: 20 s between pings, 10 s for the answer. Until then the operator
keeps streaming into a dead connection while a new shard leader, elected in seconds, has no session for
the cluster (no roll-ups, no bootstrap answers, no reclaim acks).

gRPC 1.85 times a keepalive ping out after ``grpc.http2.ping_timeout_ms`` (60 s by default), not after
``grpc.keepalive_timeout_ms``: a frozen shard was noticed 80 s after it stopped (a black-box run with a
3-replica shard group: the operator reached the new leader 100 s after SIGSTOP, the new leader had led
for 93 s of them). The test runs with the shared channel options as every BigFleet client dials (gRPC
does not let a client ping much more often, so it takes about 30 s)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bigfleet.rpc import insecure_channel
from bigfleet.rpc.options import KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS
from bigfleet.testing import ManagedProcess, free_port, wait_for_health


@pytest.mark.slow
async def test_a_stream_to_a_frozen_server_ends_within_the_keepalive_timeout(tmp_path: Path) -> None:
    port = free_port()
    provider = ManagedProcess.bigfleet(["fake-provider", "--listen", f"127.0.0.1:{port}"], "provider",
                                       log_dir=tmp_path).start()
    try:
        await asyncio.to_thread(wait_for_health, f"127.0.0.1:{port}", 30)
        async with insecure_channel(f"127.0.0.1:{port}") as ch:
            stream = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
            assert (await stream.read()).status == health_pb2.HealthCheckResponse.SERVING
            provider.signal(signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(stream.read(), timeout=90)
            waited = time.monotonic() - t0
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # one ping interval, the ping's timeout, and room for a loaded box (gRPC's default: 80 s)
        assert waited < (KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS) / 1000 + 8, f"frozen server noticed after {waited:.1f}s"
    finally:
        os.kill(provider.pid, signal.SIGCONT)
        provider.stop()
