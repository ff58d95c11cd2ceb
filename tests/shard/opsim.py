"""A scripted operator for tests: opens a Session, records every frame, answers bootstrap and reclaim."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from bigfleet.rpc import insecure_channel
from bigfleet.v1alpha1 import capacity_pb2, shard_pb2, shard_pb2_grpc


def need(cpu: str = "1", priority: int = 100, zone: str | None = None, count: int = 1,
         interruption_bucket: int = 0) -> capacity_pb2.CapacityNeed:
    reqs = []
    if zone:
        reqs.append(capacity_pb2.NodeSelectorRequirement(
            key="topology.kubernetes.io/zone", operator=capacity_pb2.NodeSelectorRequirement.OPERATOR_IN, values=[zone]))
    milli = int(float(cpu) * 1000) * count
    return capacity_pb2.CapacityNeed(
        requirements=reqs, aggregate_resources={"cpu": f"{milli}m"}, priority=priority,
        min_unit={"cpu": cpu}, interruption_penalty_bucket=interruption_bucket,  # type: ignore[arg-type]
    )


@dataclass
class FakeOperator:
    target: str
    cluster_id: str
    blob: bytes = b"#cloud-config\n"
    bootstrap_error: str = ""
    answer_bootstrap: bool = True
    ack_reclaims: bool = True
    frames: list[shard_pb2.ShardMessage] = field(default_factory=list)
    status: grpc.StatusCode | None = None
    details: str = ""
    trailers: tuple[tuple[str, str], ...] = ()  # the trailing metadata the reader saw the call end with
    on_frame: Callable[[shard_pb2.ShardMessage], None] | None = None
    tls: Any = None  # a bigfleet.security.tls.TLSConfig for mTLS

    async def __aenter__(self) -> FakeOperator:
        if self.tls is not None:
            from bigfleet.security.tls import dial

            self._channel = dial(self.target, self.tls)
        else:
            self._channel = insecure_channel(self.target)
        self._call = shard_pb2_grpc.ShardStub(self._channel).Session()
        # grpc.aio allows one write in flight per call: the reader's automatic answers and the
        # test's own sends take turns (a second concurrent write fails with TOO_MANY_OPERATIONS).
        self._write_lock = asyncio.Lock()
        await self._call.write(shard_pb2.OperatorMessage(hello=shard_pb2.Hello(cluster_id=self.cluster_id,
                                                                                protocol_version="v1alpha1")))
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(BaseException):
            await self._reader
        await self._channel.close()

    async def send_rollup(self, needs: list[capacity_pb2.CapacityNeed], cluster_id: str | None = None) -> None:
        await self.send(shard_pb2.OperatorMessage(rollup=capacity_pb2.ClusterCapacityNeeds(
            cluster_id=self.cluster_id if cluster_id is None else cluster_id, needs=needs)))

    async def send(self, msg: shard_pb2.OperatorMessage) -> None:
        async with self._write_lock:
            await self._call.write(msg)

    async def _read(self) -> None:
        try:
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:
                    break
                self.frames.append(msg)
                if self.on_frame:
                    self.on_frame(msg)
                kind = msg.WhichOneof("payload")
                if kind == "bootstrap_request" and self.answer_bootstrap:
                    await self.send(shard_pb2.OperatorMessage(bootstrap_response=shard_pb2.BootstrapBlobResponse(
                        request_id=msg.bootstrap_request.request_id, user_data=self.blob, ttl_seconds=3600,
                        error=self.bootstrap_error)))
                elif kind == "reclaim_instruction" and self.ack_reclaims:
                    ri = msg.reclaim_instruction
                    await self.send(shard_pb2.OperatorMessage(reclaim_ack=shard_pb2.ReclaimAck(
                        instruction_id=ri.instruction_id, nodes_started=len(ri.nodes))))
            self.status = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            self.status = exc.code()
            self.details = exc.details() or ""
            self.trailers = tuple((str(k), str(v)) for k, v in exc.trailing_metadata() or ())

    # -- views over what arrived --------------------------------------------------------------

    def of(self, kind: str) -> list[shard_pb2.ShardMessage]:
        return [f for f in self.frames if f.WhichOneof("payload") == kind]

    def acks(self, echo: str) -> list[shard_pb2.Acknowledgement]:
        """Acks whose echo is ``echo`` exactly, or starts with it when it ends with ':'."""
        return [f.ack for f in self.of("ack")
                if (f.ack.echo.startswith(echo) if echo.endswith(":") else f.ack.echo == echo)]

    def node_updates(self, machine_id: str | None = None) -> list[shard_pb2.NodeStateUpdate]:
        return [f.node_state_update for f in self.of("node_state_update")
                if machine_id is None or f.node_state_update.machine_id == machine_id]

    def latest_node_states(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for u in self.node_updates():
            out[u.machine_id] = int(u.state)
        return out

    def reclaims(self) -> list[shard_pb2.ReclaimInstruction]:
        return [f.reclaim_instruction for f in self.of("reclaim_instruction")]
