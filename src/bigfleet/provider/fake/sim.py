"""The fake provider in-process on a virtual clock: no event loop, no threads, no sockets.

The simulator drives fleets deterministically: it calls the RPC methods with
protobuf requests and moves time forward with ``advance(now)``; transitions
finish exactly when their dwell (or timeout) has elapsed on that clock.
Contract behaviour is the same core the daemon runs, so fencing, idempotency
and revisions behave identically. ``SimStub`` puts the same object behind the
async stub shape (``await stub.Create(req, timeout=...)``) and raises
``grpc.aio.AioRpcError`` with the contract's status codes, so code written
against a real channel runs against it unchanged.
"""

from __future__ import annotations

import builtins
import heapq
import random
from dataclasses import dataclass
from typing import Any

import grpc

from bigfleet.provider.fake.backend import Dwell, FaultPlan
from bigfleet.provider.kit.core import ProviderCore, check_configure_args
from bigfleet.provider.kit.model import Fence, HostRef, Instance, Kind, KitError
from bigfleet.provider.kit.server import KitOptions
from bigfleet.v1alpha1 import provider_pb2 as pb


@dataclass(order=True)
class _Due:
    at: float
    seq: int
    machine_id: str
    kind: Kind
    op_id: str
    error: str | None


@dataclass(frozen=True)
class Completion:
    at: float
    machine_id: str
    kind: Kind
    operation_id: str
    error: str | None
    applied: bool


class SimProvider:
    """A provider whose substrate and clock are both simulated."""

    def __init__(
        self,
        catalog: list[Instance],
        dwell: Dwell | None = None,
        faults: FaultPlan | None = None,
        options: KitOptions | None = None,
        now: float = 0.0,
        provider: str = "fake",
        list_seed: int = 0,
    ) -> None:
        self.options = options or KitOptions()
        self.core = ProviderCore(op_prefix=self.options.op_prefix)
        self.core.seed(catalog, self.options.require_zone)
        self.dwell = dwell or Dwell()
        self.faults = faults or FaultPlan()
        self.now = now
        self.provider = provider
        self.rng = random.Random(list_seed)
        self._due: list[_Due] = []
        self._seq = 0

    # ---- the six RPCs ----------------------------------------------------------------------------

    def _accept(self, kind: Kind, machine_id: str, fence: Fence, cluster: str = "",
                metadata: dict[str, str] | None = None) -> pb.TransitionAck:
        ack = self.core.mutate(kind, machine_id, fence, cluster, metadata)
        if ack.started:
            action = self.faults.decide(kind, ack.machine, cluster or ack.machine.cluster)
            timeout = self.options.timeout(kind)
            dwell = self.dwell.of(kind)
            if action == "hang" or dwell > timeout:
                at, err = self.now + timeout, f"{kind.value} transition timed out after {timeout:g}s"
            elif action == "fail":
                at, err = self.now + dwell, f"{kind.value} failed: simulated {kind.value} failure"
            else:
                at, err = self.now + dwell, None
            self._seq += 1
            heapq.heappush(self._due, _Due(at, self._seq, machine_id, kind, ack.operation_id, err))
        return pb.TransitionAck(operation_id=ack.operation_id, machine=ack.machine.to_proto())

    def create(self, req: pb.CreateRequest) -> pb.TransitionAck:
        return self._accept(Kind.CREATE, req.machine_id, Fence(req.shard_id, req.shard_epoch, req.sequence_number))

    def configure(self, req: pb.ConfigureRequest) -> pb.TransitionAck:
        if not req.machine_id:
            raise KitError(grpc.StatusCode.INVALID_ARGUMENT, "machine_id is empty")
        md = dict(req.shard_metadata)
        check_configure_args(req.cluster_id, md, len(req.bootstrap_blob))
        return self._accept(Kind.CONFIGURE, req.machine_id, Fence(req.shard_id, req.shard_epoch, req.sequence_number),
                            req.cluster_id, md)

    def drain(self, req: pb.DrainRequest) -> pb.TransitionAck:
        if not req.machine_id:
            raise KitError(grpc.StatusCode.INVALID_ARGUMENT, "machine_id is empty")
        if req.grace_period_seconds < 0:
            raise KitError(grpc.StatusCode.INVALID_ARGUMENT, "grace_period_seconds must be >= 0")
        return self._accept(Kind.DRAIN, req.machine_id, Fence(req.shard_id, req.shard_epoch, req.sequence_number))

    def delete(self, req: pb.DeleteRequest) -> pb.TransitionAck:
        return self._accept(Kind.DELETE, req.machine_id, Fence(req.shard_id, req.shard_epoch, req.sequence_number))

    def get(self, req: pb.MachineRef) -> pb.Machine:
        return self.core.get(req.id).to_proto()

    def list(self, req: pb.ListFilter) -> pb.MachineList:
        recs, rev = self.core.list(list(req.states), req.max_results, bytes(req.since_revision), self.rng)
        return pb.MachineList(machines=[r.to_proto() for r in recs], revision=str(rev).encode())

    def lose(self, machine_id: str, error: str = "simulated host loss") -> tuple[int, int]:
        """A Configured machine lost under its cluster (a host failure nobody asked for): it drains
        for the drain dwell and ends FAILED with `error`. Returns its (before, after) states."""
        before = int(self.core.machines[machine_id].state)
        ack = self.core.mutate(Kind.DRAIN, machine_id, Fence())
        self._seq += 1
        heapq.heappush(self._due, _Due(self.now + self.dwell.of(Kind.DRAIN), self._seq, machine_id, Kind.DRAIN,
                                       ack.operation_id, error))
        return before, int(self.core.machines[machine_id].state)

    # ---- time ------------------------------------------------------------------------------------

    def next_due(self) -> float | None:
        return self._due[0].at if self._due else None

    def advance(self, now: float) -> builtins.list[Completion]:
        """Move the clock to ``now`` and finish every transition due by then, in due order."""
        if now < self.now:
            raise ValueError("time does not go backwards")
        done: builtins.list[Completion] = []
        while self._due and self._due[0].at <= now:
            d = heapq.heappop(self._due)
            self.now = d.at
            host = None
            if d.kind == Kind.CREATE and d.error is None:
                cloud = self.core.machines[d.machine_id].labels.get("bigfleet.fake/cloud", "cloud")
                host = HostRef(f"{self.provider}-{cloud}", f"i-{d.op_id}")
            applied = self.core.complete(d.machine_id, d.kind, d.op_id, d.error, host=host)
            done.append(Completion(d.at, d.machine_id, d.kind, d.op_id, d.error, applied))
        self.now = now
        return done


class SimStub:
    """``CapacityProviderStub``-shaped async facade over a SimProvider (in-process, no wire)."""

    def __init__(self, sim: SimProvider) -> None:
        self.sim = sim

    @staticmethod
    def _err(exc: KitError) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(exc.code, grpc.aio.Metadata(), grpc.aio.Metadata(), exc.message)

    async def _call(self, fn: Any, req: Any) -> Any:
        try:
            # Round-trip through bytes so callers get exactly what a wire would give them.
            out = fn(type(req).FromString(req.SerializeToString()))
            return type(out).FromString(out.SerializeToString())
        except KitError as exc:
            raise self._err(exc) from None

    async def Create(self, req: pb.CreateRequest, **_: Any) -> pb.TransitionAck:
        return await self._call(self.sim.create, req)  # type: ignore[no-any-return]

    async def Configure(self, req: pb.ConfigureRequest, **_: Any) -> pb.TransitionAck:
        return await self._call(self.sim.configure, req)  # type: ignore[no-any-return]

    async def Drain(self, req: pb.DrainRequest, **_: Any) -> pb.TransitionAck:
        return await self._call(self.sim.drain, req)  # type: ignore[no-any-return]

    async def Delete(self, req: pb.DeleteRequest, **_: Any) -> pb.TransitionAck:
        return await self._call(self.sim.delete, req)  # type: ignore[no-any-return]

    async def Get(self, req: pb.MachineRef, **_: Any) -> pb.Machine:
        return await self._call(self.sim.get, req)  # type: ignore[no-any-return]

    async def List(self, req: pb.ListFilter, **_: Any) -> pb.MachineList:
        return await self._call(self.sim.list, req)  # type: ignore[no-any-return]
