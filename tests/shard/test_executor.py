"""Executor flows against a real provider kit server on loopback, counting the RPCs each flow makes.

The counts are the point: a Create flow is one Create and one Configure (completions are read from a
shared incremental List, not per-machine Get polling), steps of flows under way go before new
flows, and a flow waiting on an operator or the provider holds no concurrency slot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from bigfleet.observability import new_registry
from bigfleet.provider.fake.backend import Dwell, FaultPlan, FaultRule, SimulatedCloud
from bigfleet.provider.fake.catalog import build_catalog
from bigfleet.provider.kit.model import Kind
from bigfleet.provider.kit.server import KitOptions, RunningProvider, serve
from bigfleet.rpc import insecure_channel
from bigfleet.shard.executor import Binding, Executor, ExecutorConfig, Slots
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.provider_client import ProviderClient
from bigfleet.shard.sessions import BootstrapResult, ReclaimSent, SessionRegistry
from bigfleet.shard.view import MachineView
from bigfleet.v1alpha1 import provider_pb2, provider_pb2_grpc, shard_pb2

S = provider_pb2.MachineState


class _Session:
    """Answers bootstrap pulls at once; reclaim acks only if ``ack_reclaims``."""

    def __init__(self, cluster_id: str, ack_reclaims: bool = True) -> None:
        self.cluster_id = cluster_id
        self.ack_reclaims = ack_reclaims
        self.bootstraps = 0
        self.reclaims = 0

    async def request_bootstrap(self, requirements: list[Any], timeout: float) -> BootstrapResult:
        self.bootstraps += 1
        await asyncio.sleep(0)
        return BootstrapResult(b"#cloud-config\n", 3600, "")

    def reclaim(self, nodes: list[str], grace_seconds: int, preemptor_priority: int) -> ReclaimSent:
        """Delivered at once (the operator has it); acked at once only if ``ack_reclaims``."""
        self.reclaims += 1
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        delivered: asyncio.Future[None] = loop.create_future()
        delivered.set_result(None)
        if self.ack_reclaims:
            fut.set_result(len(nodes))
        return ReclaimSent("i", shard_pb2.ShardMessage(), delivered, fut)


class _Sessions(SessionRegistry):
    def __init__(self, ack_reclaims: bool = True) -> None:
        super().__init__()
        self.ack_reclaims = ack_reclaims
        self.by_cluster: dict[str, _Session] = {}

    def get(self, cluster_id: str) -> Any:
        s = self.by_cluster.get(cluster_id)
        if s is None:
            s = self.by_cluster[cluster_id] = _Session(cluster_id, self.ack_reclaims)
        return s

    @property
    def bootstraps(self) -> int:
        return sum(s.bootstraps for s in self.by_cluster.values())


def binding(cluster: str = "c1", fp: str = "fp-1") -> Binding:
    return Binding(cluster, fp, 100, 64.0, 64.0, ())


@dataclass
class Rig:
    executor: Executor
    view: MachineView
    client: ProviderClient
    provider: RunningProvider
    sessions: _Sessions
    registry: CollectorRegistry
    cloud: SimulatedCloud
    ids: list[str] = field(default_factory=list)

    def rpcs(self, method: str) -> int:
        """RPCs the provider answered, any status."""
        total = 0.0
        for metric in self.registry.collect():
            for s in metric.samples:
                if s.name == "bigfleet_provider_rpcs_total" and s.labels.get("method") == method:
                    total += s.value
        return int(total)

    def states(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for pb in self.view.all():
            out[S.Name(pb.state)] = out.get(S.Name(pb.state), 0) + 1
        return out


@asynccontextmanager
async def rig(n: int, dwell: Dwell | None = None, faults: FaultPlan | None = None, ack_reclaims: bool = True,
              wire: Callable[[Any], Any] | None = None, **cfg: Any) -> AsyncIterator[Rig]:
    """`wire` wraps the provider's stub (answers the kit cannot be made to give)."""
    registry = CollectorRegistry()
    cloud = SimulatedCloud(build_catalog(n), "fake", dwell or Dwell(), faults)
    provider = await serve(cloud, options=KitOptions(list_seed=1), registry=registry)
    metrics = ShardMetrics(new_registry())
    target = f"127.0.0.1:{provider.port}"
    channel = insecure_channel(target) if wire is not None else None
    stub = wire(provider_pb2_grpc.CapacityProviderStub(channel)) if wire is not None else None
    client = ProviderClient(target, "s1", 1, metrics, stub=stub)
    view = MachineView()
    lst = await client.list()
    for pb in lst.machines:
        assert view.set(pb)
    sessions = _Sessions(ack_reclaims)
    config = ExecutorConfig(**cfg)
    executor = Executor(view, client, sessions, lambda c, fp, prio: binding(c, fp), config, metrics)
    r = Rig(executor, view, client, provider, sessions, registry, cloud, sorted(pb.id for pb in lst.machines))
    try:
        yield r
    finally:
        await executor.drain_all(5.0)
        await client.close()
        if channel is not None:
            await channel.close()
        await provider.stop(0)


async def until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def settled(r: Rig) -> bool:
    return not r.view.inflight


async def test_create_flow_is_one_create_and_one_configure_no_get() -> None:
    async with rig(60) as r:
        for i, mid in enumerate(r.ids):
            assert r.executor.submit_create(mid, binding(f"c{i % 3}"))
        await until(lambda: settled(r), 30, "all flows to finish")
        assert r.states() == {"MACHINE_STATE_CONFIGURED": 60}
        assert r.rpcs("Create") == 60
        assert r.rpcs("Configure") == 60
        assert r.rpcs("Get") == 0  # completions came from the shared List
        lists = r.rpcs("List") - 1  # (the rig's own initial List)
        assert lists == r.executor.watch_lists
        assert 1 <= lists < 60  # one List serves many waiting flows
        assert r.sessions.bootstraps == 60
        assert r.cloud.calls[Kind.CREATE] == 60 and r.cloud.calls[Kind.CONFIGURE] == 60
        for pb in r.view.all():
            assert pb.cluster in {"c0", "c1", "c2"}


async def test_get_polling_mode_still_works() -> None:
    async with rig(10, watch=False, poll_interval=0.01) as r:
        for mid in r.ids:
            assert r.executor.submit_create(mid, binding())
        await until(lambda: settled(r), 30, "all flows to finish")
        assert r.states() == {"MACHINE_STATE_CONFIGURED": 10}
        assert r.rpcs("Create") == 10 and r.rpcs("Configure") == 10
        assert r.rpcs("Get") >= 20  # at least one per transition
        assert r.rpcs("List") == 1  # only the rig's


async def test_a_machine_already_in_flight_is_not_acted_on_twice() -> None:
    async with rig(5) as r:
        mid = r.ids[0]
        assert r.executor.submit_create(mid, binding())
        assert not r.executor.submit_create(mid, binding())
        assert not r.executor.submit_configure(mid, binding())
        await until(lambda: settled(r), 30, "the flow to finish")
        assert r.rpcs("Create") == 1 and r.rpcs("Configure") == 1


async def test_drain_and_delete_flows_without_polling() -> None:
    async with rig(8, reclaim_ack_timeout=1.0) as r:
        for mid in r.ids:
            r.executor.submit_create(mid, binding())
        await until(lambda: settled(r), 30, "creates")
        for mid in r.ids:
            assert r.executor.submit_drain(mid, 0, 0, "reclaim")
        await until(lambda: settled(r), 30, "drains")
        assert r.states() == {"MACHINE_STATE_IDLE": 8}
        for mid in r.ids:
            assert r.executor.submit_delete(mid)
        await until(lambda: settled(r), 30, "deletes")
        assert r.states() == {"MACHINE_STATE_SPECULATIVE": 8}
        assert (r.rpcs("Drain"), r.rpcs("Delete"), r.rpcs("Get")) == (8, 8, 0)
        assert sum(s.reclaims for s in r.sessions.by_cluster.values()) == 8


async def test_a_transition_that_never_finishes_fails_with_a_reason_after_one_last_get() -> None:
    faults = FaultPlan([FaultRule("hang", kinds=frozenset({Kind.CREATE}))])
    async with rig(4, faults=faults, execute_timeout=0.6) as r:
        for mid in r.ids:
            r.executor.submit_create(mid, binding())
        await until(lambda: settled(r), 30, "timeouts")
        assert r.states() == {"MACHINE_STATE_FAILED": 4}
        for pb in r.view.all():
            assert "Create: timed out" in pb.last_error and "CREATING" in pb.last_error
        assert r.rpcs("Get") == 4  # exactly one last look per machine
        assert r.rpcs("Configure") == 0


async def test_a_provider_failure_is_observed_from_the_list() -> None:
    faults = FaultPlan([FaultRule("fail", kinds=frozenset({Kind.CONFIGURE}))])
    async with rig(3, faults=faults) as r:
        for mid in r.ids:
            r.executor.submit_create(mid, binding())
        await until(lambda: settled(r), 30, "flows")
        assert r.states() == {"MACHINE_STATE_FAILED": 3}
        assert all("configure failed" in pb.last_error for pb in r.view.all())
        assert r.rpcs("Get") == 0


async def test_a_drain_waiting_for_its_reclaim_ack_holds_no_slot() -> None:
    async with rig(4, ack_reclaims=False, concurrency=1, reclaim_ack_timeout=20.0) as r:
        first, rest = r.ids[0], r.ids[1:]
        r.executor.submit_create(first, binding())
        await until(lambda: settled(r), 30, "the first machine")
        r.executor.submit_drain(first, 30, 0, "reclaim")  # its operator never acks: waits 20 s
        started = time.monotonic()
        for mid in rest:
            r.executor.submit_create(mid, binding())
        await until(lambda: all(r.view.get(m).state == S.MACHINE_STATE_CONFIGURED for m in rest), 15,  # type: ignore[union-attr]
                    "creates behind a waiting drain")
        assert time.monotonic() - started < 15
        assert first in r.view.inflight  # still waiting for its ack


class _BlockingProvider:
    """A provider client whose lifecycle calls block until released; records calls in flight."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.in_flight = 0
        self.max_in_flight = 0
        self.order: list[str] = []

    async def _mutate(self, name: str, machine_id: str, state: int) -> provider_pb2.TransitionAck:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.order.append(f"{name}:{machine_id}")
        try:
            await self.release.wait()
        finally:
            self.in_flight -= 1
        m = provider_pb2.Machine(id=machine_id, state=state, zone="z", instance_type="t",  # type: ignore[arg-type]
                                 capacity_type=provider_pb2.CAPACITY_TYPE_ON_DEMAND,
                                 host=provider_pb2.HostRef(provider="p", ref=f"h-{machine_id}"))
        return provider_pb2.TransitionAck(operation_id="op", machine=m)

    async def create(self, machine_id: str) -> provider_pb2.TransitionAck:
        return await self._mutate("create", machine_id, S.MACHINE_STATE_IDLE)

    async def configure(self, machine_id: str, cluster_id: str, blob: bytes, md: dict[str, str]) -> Any:
        ack = await self._mutate("configure", machine_id, S.MACHINE_STATE_CONFIGURED)
        ack.machine.cluster = cluster_id
        ack.machine.shard_metadata.update(md)
        return ack


async def test_concurrency_bounds_calls_in_flight_and_started_flows_go_first() -> None:
    prov = _BlockingProvider()
    view = MachineView()
    ids = [f"m{i:02d}" for i in range(12)]
    for mid in ids:
        view.set(provider_pb2.Machine(id=mid, state=S.MACHINE_STATE_SPECULATIVE, zone="z", instance_type="t",
                                      capacity_type=provider_pb2.CAPACITY_TYPE_ON_DEMAND))
    ex = Executor(view, prov, _Sessions(), lambda c, fp, p: binding(c, fp),  # type: ignore[arg-type]
                  ExecutorConfig(concurrency=4))
    for mid in ids:
        ex.submit_create(mid, binding())
    await until(lambda: prov.in_flight == 4, 5, "4 calls in flight")
    await asyncio.sleep(0.05)
    assert prov.max_in_flight == 4
    prov.release.set()
    await until(lambda: not view.inflight, 10, "all flows")
    assert prov.max_in_flight == 4
    assert all(view.get(m).state == S.MACHINE_STATE_CONFIGURED for m in ids)  # type: ignore[union-attr]
    # A Configure (a flow under way) goes before Creates that were queued long before it but have
    # not started yet.
    assert prov.order.index("configure:m00") < prov.order.index("create:m11")


async def test_slots_hand_over_to_urgent_waiters_first() -> None:
    slots = Slots(1)
    await slots.acquire(urgent=False)
    got: list[str] = []

    async def take(name: str, urgent: bool) -> None:
        await slots.acquire(urgent)
        got.append(name)

    normal = asyncio.create_task(take("normal", False))
    await asyncio.sleep(0)
    urgent = asyncio.create_task(take("urgent", True))
    await asyncio.sleep(0)
    cancelled = asyncio.create_task(take("cancelled", True))
    await asyncio.sleep(0)
    assert slots.waiting == 3
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    assert slots.waiting == 2
    slots.release()
    await asyncio.sleep(0)
    assert got == ["urgent"]
    slots.release()
    await asyncio.sleep(0)
    assert got == ["urgent", "normal"]
    slots.release()
    assert slots.free == 1 and slots.waiting == 0
    await asyncio.gather(normal, urgent)


async def test_time_spent_queueing_for_a_slot_does_not_count_against_the_transition_timeout() -> None:
    async with rig(6, concurrency=1, execute_timeout=0.5) as r:
        await r.executor._slots.acquire(urgent=False)  # the only slot is busy elsewhere ...
        for mid in r.ids:
            r.executor.submit_create(mid, binding())
        await asyncio.sleep(1.2)  # ... for longer than a transition may take
        assert r.rpcs("Create") == 0
        r.executor._slots.release()
        await until(lambda: settled(r), 30, "the queued flows")
        assert r.states() == {"MACHINE_STATE_CONFIGURED": 6}


async def test_a_list_that_was_in_flight_when_a_flow_ended_is_not_applied_over_it() -> None:
    async with rig(3) as r:
        mid, other = r.ids[0], r.ids[1]
        cursor = (await r.client.list()).revision
        mark = r.executor.end_mark()  # what the daemon's reconcile takes before its List call
        r.executor.submit_create(mid, binding("c1"))
        await until(lambda: settled(r), 30, "the flow")
        assert r.executor.ended_after(mid, mark) and not r.executor.ended_after(other, mark)
        assert not r.executor.ended_after(mid, r.executor.end_mark())
        # A List served mid-flow shows the machine still Idle; applied now it would regress the view
        # (and the engine would configure the machine a second time). The daemon sets it aside
        # and asks for a recheck instead, which reads the machine fresh.
        stale = provider_pb2.Machine()
        stale.CopyFrom(r.view.get(mid))  # type: ignore[arg-type]
        stale.state = S.MACHINE_STATE_IDLE
        stale.cluster = ""
        stale.shard_metadata.clear()
        r.executor.recheck(r.view.get(mid))  # type: ignore[arg-type]  # same as the view: nothing to do
        assert r.executor.rechecks == 0
        r.executor.recheck(stale)
        await until(lambda: r.executor.rechecks == 1 and not r.executor._tasks, 10, "the recheck")
        assert r.view.get(mid).state == S.MACHINE_STATE_CONFIGURED  # type: ignore[union-attr]
        assert r.view.get(mid).cluster == "c1"  # type: ignore[union-attr]
        assert r.rpcs("Get") == 1
        assert [pb.id for pb in (await r.client.list(cursor)).machines] == [mid]


@pytest.mark.parametrize("watch", [True, False])
async def test_a_drain_may_take_its_grace_period_on_top_of_the_execute_timeout(watch: bool) -> None:
    async with rig(2, dwell=Dwell(drain=1.0), execute_timeout=0.5, watch=watch, poll_interval=0.05) as r:
        mid = r.ids[0]
        r.executor.submit_create(mid, binding())
        await until(lambda: settled(r), 30, "the create")
        assert r.executor.submit_drain(mid, 2, 0, "reclaim")  # 1 s of drain < 0.5 s + 2 s grace
        await until(lambda: settled(r), 30, "the drain")
        assert r.view.get(mid).state == S.MACHINE_STATE_IDLE, r.view.get(mid).last_error  # type: ignore[union-attr]


async def test_long_waits_get_a_direct_look_not_a_full_list() -> None:
    """A flow waiting longer than watch_full_after gets one Get of its own machine per period; the
    shared watch never falls back to a full List (at 10^5 machines that stalls the session loop)."""
    async with rig(6, dwell=Dwell(create=1.2), watch_full_after=0.3, execute_timeout=20) as r:
        cursors: list[bytes] = []
        real_list = r.client.list

        async def recording_list(since: bytes = b"", **kw: Any) -> Any:
            cursors.append(since)
            return await real_list(since, **kw)

        r.executor.provider.list = recording_list  # type: ignore[method-assign]
        for i, mid in enumerate(r.ids):
            assert r.executor.submit_create(mid, binding(f"c{i % 2}"))
        await until(lambda: settled(r), 30, "all flows to finish")
        assert r.states() == {"MACHINE_STATE_CONFIGURED": 6}
        assert sum(1 for c in cursors if not c) == 1  # only the very first watch List was a full one
        assert r.executor.confirm_gets >= 6  # each long-waiting flow was looked at directly
        assert r.rpcs("Get") == r.executor.confirm_gets


class _QuotaStub:
    """The provider's stub, but Create is refused RESOURCE_EXHAUSTED (a cloud out of capacity or
    quota) while `refusing` is set."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.refusing = True
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    async def Create(self, req: provider_pb2.CreateRequest, timeout: float) -> provider_pb2.TransitionAck:
        if self.refusing:
            self.refused += 1
            raise grpc.aio.AioRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="InsufficientInstanceCapacity")
        out: provider_pb2.TransitionAck = await self.real.Create(req, timeout=timeout)
        return out


async def test_a_create_refused_for_capacity_cools_the_slot_down_instead_of_failing_it() -> None:
    """RESOURCE_EXHAUSTED through every retry on a slot still Speculative at the provider: shown FAILED
    with the reason for the cool-down, then offered again (it used to stay FAILED for the whole
    leadership term: a quota error burned the pool within seconds)."""
    stubs: list[_QuotaStub] = []

    def refusing(real: Any) -> _QuotaStub:
        stubs.append(_QuotaStub(real))
        return stubs[-1]

    async with rig(3, wire=refusing, capacity_cooldown=5.0) as r:
        stub, view, executor = stubs[0], r.view, r.executor
        for mid in r.ids:
            executor.submit_create(mid, binding())
        await until(lambda: settled(r), 30, "refused Creates")
        assert stub.refused == 3 * r.client.max_attempts
        for pb in view.all():
            assert pb.state == provider_pb2.MACHINE_STATE_FAILED
            assert "RESOURCE_EXHAUSTED" in pb.last_error and "out of capacity: tried again after 5s" in pb.last_error
        assert set(view.cooling) == set(r.ids)
        assert view.end_cooldowns(executor.clock()) == []  # not over yet
        assert view.end_cooldowns(executor.clock() + 5.0) == r.ids
        assert {pb.state for pb in view.all()} == {provider_pb2.MACHINE_STATE_SPECULATIVE}
        assert not view.failed_local and not view.cooling
        stub.refusing = False  # capacity is back: the same slots are created and configured
        for mid in r.ids:
            executor.submit_create(mid, binding())
        await until(lambda: settled(r), 30, "Creates")
        assert r.states() == {"MACHINE_STATE_CONFIGURED": 3}
