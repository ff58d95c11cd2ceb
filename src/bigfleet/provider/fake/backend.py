"""The simulated cloud behind the fake provider: dwell times and fault injection.

Time is injected (``sleep``) so the same backend runs in real time in the
daemon and instantly or on a virtual clock in tests; randomness is a seeded
``random.Random``, so a failure-rate run is reproducible.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from bigfleet.provider.kit.backend import (
    Backend,
    ConfigureCall,
    CreateCall,
    CreateResult,
    DeleteCall,
    DrainCall,
)
from bigfleet.provider.kit.model import HostRef, Instance, Kind, MachineRecord

Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class FaultRule:
    """Fail or hang the transitions of machines matching a cluster id and/or a label."""

    action: str  # "fail" | "hang"
    cluster: str | None = None
    label: tuple[str, str] | None = None
    kinds: frozenset[Kind] = frozenset(Kind)

    def matches(self, kind: Kind, machine: MachineRecord, cluster: str) -> bool:
        if kind not in self.kinds:
            return False
        if self.cluster is not None and cluster != self.cluster:
            return False
        return not (self.label is not None and machine.labels.get(self.label[0]) != self.label[1])


@dataclass
class FaultPlan:
    rules: list[FaultRule] = field(default_factory=list)
    fail_rate: float = 0.0
    rate_kinds: frozenset[Kind] = frozenset(Kind)
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.fail_rate <= 1.0:
            raise ValueError("fail_rate must be in [0, 1]")
        self.rng = random.Random(self.seed)

    def decide(self, kind: Kind, machine: MachineRecord, cluster: str) -> str | None:
        for rule in self.rules:
            if rule.matches(kind, machine, cluster):
                return rule.action
        if self.fail_rate > 0 and kind in self.rate_kinds and self.rng.random() < self.fail_rate:
            return "fail"
        return None


@dataclass
class Dwell:
    """Seconds each kind of transition takes in the simulated cloud (0 = instant)."""

    create: float = 0.0
    configure: float = 0.0
    drain: float = 0.0
    delete: float = 0.0

    def of(self, kind: Kind) -> float:
        return {Kind.CREATE: self.create, Kind.CONFIGURE: self.configure, Kind.DRAIN: self.drain,
                Kind.DELETE: self.delete}[kind]


class SimulatedCloud(Backend):
    """A Backend whose substrate is a dict: hosts appear on create and vanish on delete."""

    def __init__(
        self,
        catalog: list[Instance],
        provider: str = "fake",
        dwell: Dwell | None = None,
        faults: FaultPlan | None = None,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        self.catalog = catalog
        self.provider = provider
        self.dwell = dwell or Dwell()
        self.faults = faults or FaultPlan()
        self.sleep = sleep
        self.hosts: dict[str, HostRef] = {}  # machine id -> host, the substrate's truth
        self.bindings: dict[str, str] = {}  # machine id -> cluster
        self.calls: dict[Kind, int] = dict.fromkeys(Kind, 0)
        for inst in catalog:
            if inst.host is not None:
                self.hosts[inst.id] = inst.host

    async def describe(self) -> list[Instance]:
        return list(self.catalog)

    async def _step(self, kind: Kind, machine: MachineRecord, cluster: str) -> None:
        self.calls[kind] += 1
        action = self.faults.decide(kind, machine, cluster)
        if action == "hang":
            await asyncio.Event().wait()
        delay = self.dwell.of(kind)
        if delay > 0:
            await self.sleep(delay)
        if action == "fail":
            raise RuntimeError(f"simulated {kind.value} failure")

    async def create_instance(self, call: CreateCall) -> CreateResult:
        await self._step(Kind.CREATE, call.machine, "")
        cloud = call.machine.labels.get("bigfleet.fake/cloud", "cloud")
        host = self.hosts.get(call.machine.id) or HostRef(f"{self.provider}-{cloud}", f"i-{call.operation_id}")
        self.hosts[call.machine.id] = host
        return CreateResult(host)

    async def configure_instance(self, call: ConfigureCall) -> None:
        await self._step(Kind.CONFIGURE, call.machine, call.cluster_id)
        self.bindings[call.machine.id] = call.cluster_id

    async def drain_instance(self, call: DrainCall) -> None:
        await self._step(Kind.DRAIN, call.machine, call.machine.cluster)
        self.bindings.pop(call.machine.id, None)

    async def delete_instance(self, call: DeleteCall) -> None:
        await self._step(Kind.DELETE, call.machine, "")
        self.hosts.pop(call.machine.id, None)
