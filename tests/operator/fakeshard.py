"""A test double of the shard's Session endpoint: a real grpc.aio server on loopback.

It records every operator frame, acks Hello and roll-ups like the shard does,
and lets a test push any ShardMessage to a connected cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from bigfleet.rpc import new_server
from bigfleet.security.identity import peer_identity
from bigfleet.security.tls import TLSConfig, add_port
from bigfleet.testing import free_port
from bigfleet.v1alpha1 import capacity_pb2, shard_pb2, shard_pb2_grpc


@dataclass
class Conn:
    cluster_id: str
    outbox: asyncio.Queue[shard_pb2.ShardMessage | None] = field(default_factory=asyncio.Queue)
    abort: tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]] | None = None


class FakeShard(shard_pb2_grpc.ShardServicer):
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.server: grpc.aio.Server | None = None
        self.rollups: list[capacity_pb2.ClusterCapacityNeeds] = []
        self.bootstrap_responses: list[shard_pb2.BootstrapBlobResponse] = []
        self.reclaim_acks: list[shard_pb2.ReclaimAck] = []
        self.registration_timeouts: list[shard_pb2.NodeRegistrationTimeout] = []
        self.hellos: list[shard_pb2.Hello] = []
        self.peers: list[str] = []
        self.conns: dict[str, Conn] = {}
        self.sessions_opened = 0
        self.active = 0
        self.max_active = 0
        self.on_open: Callable[[Conn], None] | None = None
        # A stepped-down leader: new Sessions are refused at their Hello with this redirect.
        self.refuse_with_redirect = ""

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, tls: TLSConfig | None = None) -> FakeShard:
        self.server, _ = new_server()
        shard_pb2_grpc.add_ShardServicer_to_server(self, self.server)
        add_port(self.server, self.target, tls)
        await self.server.start()
        return self

    async def stop(self) -> None:
        for c in self.conns.values():
            c.outbox.put_nowait(None)
        if self.server is not None:
            await self.server.stop(0.2)
            self.server = None

    async def Session(
        self, request_iterator: AsyncIterator[shard_pb2.OperatorMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[shard_pb2.ShardMessage]:
        it = request_iterator.__aiter__()
        first = await it.__anext__()
        if first.WhichOneof("payload") != "hello" or not first.hello.cluster_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first frame must be Hello with cluster_id")
        self.hellos.append(first.hello)
        if self.refuse_with_redirect:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "not the shard leader",
                                trailing_metadata=(("bigfleet-redirect", self.refuse_with_redirect),))
        self.peers.append(str(peer_identity(context)))
        conn = Conn(first.hello.cluster_id)
        old = self.conns.get(conn.cluster_id)
        if old is not None:
            old.outbox.put_nowait(None)
        self.conns[conn.cluster_id] = conn
        self.sessions_opened += 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)

        async def reader() -> None:
            async for m in it:
                kind = m.WhichOneof("payload")
                if kind == "rollup":
                    self.rollups.append(m.rollup)
                    conn.outbox.put_nowait(shard_pb2.ShardMessage(ack=shard_pb2.Acknowledgement(echo="rollup")))
                elif kind == "bootstrap_response":
                    self.bootstrap_responses.append(m.bootstrap_response)
                elif kind == "reclaim_ack":
                    self.reclaim_acks.append(m.reclaim_ack)
                elif kind == "registration_timeout":
                    self.registration_timeouts.append(m.registration_timeout)
            conn.outbox.put_nowait(None)

        rtask = asyncio.create_task(reader())
        try:
            yield shard_pb2.ShardMessage(ack=shard_pb2.Acknowledgement(echo="hello", shard_epoch=1))
            if self.on_open is not None:
                self.on_open(conn)
            while True:
                msg = await conn.outbox.get()
                if msg is None:
                    break
                yield msg
            if conn.abort is not None:
                code, details, md = conn.abort
                context.set_trailing_metadata(md)
                await context.abort(code, details)
        finally:
            self.active -= 1
            rtask.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await rtask
            if self.conns.get(conn.cluster_id) is conn:
                del self.conns[conn.cluster_id]

    def send(self, cluster_id: str, msg: shard_pb2.ShardMessage) -> None:
        self.conns[cluster_id].outbox.put_nowait(msg)

    def close_with(self, cluster_id: str, code: grpc.StatusCode, details: str,
                   metadata: tuple[tuple[str, str], ...] = ()) -> None:
        conn = self.conns[cluster_id]
        conn.abort = (code, details, metadata)
        conn.outbox.put_nowait(None)


async def eventually(pred: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> object:
    """Async condition wait (the loop keeps serving the API server and the fake shard meanwhile)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: BaseException | None = None
    while True:
        try:
            v = pred()
            if v:
                return v
        except AssertionError:
            raise  # a predicate's assertion means "give up now", not "not yet"
        except Exception as exc:
            last = exc
        if loop.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}" + (f" (last error: {last!r})" if last else ""))
        await asyncio.sleep(0.02)
