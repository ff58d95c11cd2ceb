"""Simulated cluster operators speaking the real ``Shard.Session`` protocol over gRPC.

Each one owns a ``SimCluster`` demand model (the simulator's): every tick it
rolls up its whole current demand, answers bootstrap pulls and reclaim
instructions, and follows its nodes from NodeStateUpdates. It reconnects
after a lost stream, as a real operator does.

It finds its shard as ``bigfleet operator --coordinator ...`` does, through the operator's own
``CoordinatorResolver``: ``Coordinator.LookupCluster`` on each coordinator address in turn (which
places the cluster on a shard on first contact), the last answer reused while no coordinator
answers, and a shard's ``bigfleet-redirect`` trailer followed once. Only the resolver's cache
differs: a real operator keeps it in a ConfigMap; a simulated cluster has no Kubernetes API, so
it stays in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import grpc

from bigfleet.observability import get_logger
from bigfleet.operator.app import CoordinatorResolver
from bigfleet.operator.session import REDIRECT_METADATA_KEY, Resolver
from bigfleet.security import TLSConfig, dial
from bigfleet.sim.harness import BLOB, SimCluster
from bigfleet.v1alpha1 import provider_pb2, shard_pb2, shard_pb2_grpc

log = get_logger("bigfleet.allinone.operator")
S = provider_pb2.MachineState


class _NoKubernetesAPI:
    """Stands in for the Kubernetes API client of the resolver's ConfigMap cache, which
    :class:`SimCoordinatorResolver` replaces; nothing ever calls it."""


class SimCoordinatorResolver(CoordinatorResolver):
    """The operator's ``CoordinatorResolver`` with its shard-address cache in memory instead of the
    ``bigfleet-operator-shard`` ConfigMap (lookup, placement, fallback and redirects unchanged)."""

    def __init__(self, cluster_id: str, coordinators: Sequence[str], tls: TLSConfig | None = None,
                 timeout: float = 5.0) -> None:
        super().__init__(cluster_id, tuple(coordinators), cast(Any, _NoKubernetesAPI()), namespace="",
                         timeout=timeout, tls=tls)

    async def _read_cache(self) -> str | None:
        return self.cached  # ``resolve`` keeps the last answer in ``cached``: that is the whole cache

    async def _write_cache(self, addr: str) -> None:
        return None


@dataclass
class WireOperator:
    model: SimCluster
    # Where the shard is found: a SimCoordinatorResolver (production wiring) or the operator's
    # StaticResolver (``--shard-addr``).
    resolver: Resolver
    # mTLS with this cluster's own certificate (the shard pins a Session to the cluster it names).
    tls: TLSConfig | None = None
    rollups: int = 0
    bootstraps: int = 0
    reclaims: int = 0
    connects: int = 0
    cut_off: bool = False
    last_error: str = ""
    shard: str = ""  # the shard address of the current (or last) Session
    _out: asyncio.Queue[shard_pb2.OperatorMessage] = field(default_factory=asyncio.Queue)
    _task: asyncio.Task[None] | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    _cut: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def cluster_id(self) -> str:
        return self.model.cluster_id

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"operator-{self.cluster_id}")

    async def stop(self) -> None:
        self._stop.set()
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def tick(self, cycle: int, now_ns: int) -> None:
        """Roll the current demand up (a full replacement, as the real operator sends)."""
        self.model.advance_batches(cycle)
        if self.connected.is_set() and not self.cut_off:
            self._out.put_nowait(shard_pb2.OperatorMessage(rollup=self.model.rollup(cycle, now_ns)))
            self.rollups += 1

    async def _run(self) -> None:
        delay = 0.2
        while not self._stop.is_set():
            if self.cut_off:
                await asyncio.sleep(0.2)
                continue
            try:
                await self._session()
                delay = 0.2
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                self.last_error = f"{exc.code().name}: {exc.details()}"
                redirect = _redirect(exc.trailing_metadata())
                if redirect and redirect != self.shard:
                    self.resolver.redirect(redirect)  # as the operator does: redial there at once
                    self.connected.clear()
                    continue
            except Exception as exc:  # keep the simulated cluster alive whatever happened
                self.last_error = str(exc)
                log.warning("operator session error", cluster=self.cluster_id, error=str(exc))
            self.connected.clear()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    def cut(self, on: bool) -> None:
        """Cut this operator off the shard (a partition) or let it reconnect."""
        self.cut_off = on
        if on:
            self._cut.set()
        else:
            self._cut.clear()

    async def _session(self) -> None:
        target = await self.resolver.resolve()  # every (re)connect asks again, as the operator does
        self.shard = target
        async with dial(target, self.tls) as ch:
            call = shard_pb2_grpc.ShardStub(ch).Session()
            await call.write(shard_pb2.OperatorMessage(
                hello=shard_pb2.Hello(cluster_id=self.cluster_id, protocol_version="v1alpha1")))
            self.connects += 1
            self.model.nodes.clear()  # the shard replays every bound node after the Hello
            while not self._out.empty():
                self._out.get_nowait()  # stale roll-ups: the next tick sends the current demand
            self.connected.set()
            writer = asyncio.create_task(self._write(call))
            reader = asyncio.create_task(self._read(call))
            cut = asyncio.create_task(self._cut.wait())
            try:
                done, _ = await asyncio.wait({reader, cut}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (writer, reader, cut):
                    t.cancel()
                call.cancel()
                await asyncio.gather(writer, reader, cut, return_exceptions=True)
            if reader in done and not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        async for msg in call:
            self._handle(msg)

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            await call.write(await self._out.get())

    def _handle(self, msg: shard_pb2.ShardMessage) -> None:
        kind = msg.WhichOneof("payload")
        m = self.model
        if kind == "node_state_update":
            u = msg.node_state_update
            if u.state in (S.MACHINE_STATE_CONFIGURING, S.MACHINE_STATE_CONFIGURED, S.MACHINE_STATE_DRAINING):
                m.nodes[u.machine_id] = u.state
                cpu = u.resources.resources.get("cpu", "0")
                m.node_cpu[u.machine_id] = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu or 0)
            else:
                m.nodes.pop(u.machine_id, None)
        elif kind == "bootstrap_request":
            self.bootstraps += 1
            self._out.put_nowait(shard_pb2.OperatorMessage(bootstrap_response=shard_pb2.BootstrapBlobResponse(
                request_id=msg.bootstrap_request.request_id, user_data=BLOB, ttl_seconds=3600)))
        elif kind == "reclaim_instruction":
            self.reclaims += 1
            ri = msg.reclaim_instruction
            self._out.put_nowait(shard_pb2.OperatorMessage(reclaim_ack=shard_pb2.ReclaimAck(
                instruction_id=ri.instruction_id, nodes_started=len(ri.nodes))))


def _redirect(md: Any) -> str:
    """The ``bigfleet-redirect`` trailer a shard ends a Session with, if any."""
    for k, v in md or ():
        if k == REDIRECT_METADATA_KEY and v:
            return str(v)
    return ""
