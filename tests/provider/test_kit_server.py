"""The kit's gRPC shell over real loopback gRPC: timeouts, late answers, stores, restarts, codes."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from bigfleet.provider.fake.backend import SimulatedCloud
from bigfleet.provider.fake.catalog import build_catalog
from bigfleet.provider.kit import (
    Backend,
    CapacityType,
    ConfigureCall,
    CreateCall,
    CreateResult,
    DrainCall,
    FileStore,
    HostRef,
    Instance,
    InvalidRecord,
    KitOptions,
    MemStore,
    serve,
)
from bigfleet.provider.kit.core import ProviderCore
from bigfleet.rpc import insecure_channel
from bigfleet.v1alpha1 import provider_pb2 as pb
from bigfleet.v1alpha1 import provider_pb2_grpc as pbg


class Scripted(Backend):
    """A backend whose behaviour per cluster id the test chooses."""

    def __init__(self, n: int = 4, delete: bool = True) -> None:
        self.n = n
        self.release = asyncio.Event()
        self.late_done = asyncio.Event()

    async def describe(self) -> list[Instance]:
        return [Instance(f"m{i}", "t", "z", CapacityType.ON_DEMAND, 1.0) for i in range(self.n)]

    async def create_instance(self, call: CreateCall) -> CreateResult:
        return CreateResult(HostRef("p", f"h-{call.machine.id}"), resources={"cpu": "2"})

    async def configure_instance(self, call: ConfigureCall) -> None:
        if call.cluster_id == "boom":
            raise RuntimeError("substrate said no")
        if call.cluster_id == "stubborn":
            # Ignores cancellation and "succeeds" late.
            while not self.release.is_set():
                try:
                    await self.release.wait()
                except asyncio.CancelledError:
                    continue
            self.late_done.set()

    async def confirm_node_ready(self, call: ConfigureCall) -> None:
        if call.cluster_id == "never-ready":
            raise RuntimeError("kubelet never registered")

    async def drain_instance(self, call: DrainCall) -> None:
        return None


class NoDelete(Scripted):
    delete_instance = Backend.delete_instance  # type: ignore[assignment]


async def wait_state(s: pbg.CapacityProviderStub, mid: str, state: int, timeout: float = 20.0) -> pb.Machine:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        m = await s.Get(pb.MachineRef(id=mid))
        if m.state == state:
            return m
        assert asyncio.get_running_loop().time() < deadline, f"{mid} stuck in {m.state}"
        await asyncio.sleep(0.01)


async def test_lifecycle_resources_timeout_and_late_success() -> None:
    backend = Scripted()
    running = await serve(backend, options=KitOptions(configure_timeout=0.3))
    try:
        async with insecure_channel(f"127.0.0.1:{running.port}") as ch:
            s = pbg.CapacityProviderStub(ch)
            await s.Create(pb.CreateRequest(machine_id="m0"))
            m = await wait_state(s, "m0", pb.MACHINE_STATE_IDLE)
            assert dict(m.resources.resources) == {"cpu": "2"} and m.host.ref == "h-m0"
            await s.Configure(pb.ConfigureRequest(machine_id="m0", cluster_id="stubborn"))
            m = await wait_state(s, "m0", pb.MACHINE_STATE_FAILED)
            assert "timed out" in m.last_error
            backend.release.set()
            await asyncio.wait_for(backend.late_done.wait(), 10)
            await asyncio.sleep(0.05)
            m2 = await s.Get(pb.MachineRef(id="m0"))
            assert m2.state == pb.MACHINE_STATE_FAILED and m2.last_error == m.last_error
    finally:
        await running.stop()


async def test_backend_errors_and_readiness_fail_the_machine() -> None:
    running = await serve(Scripted())
    try:
        async with insecure_channel(f"127.0.0.1:{running.port}") as ch:
            s = pbg.CapacityProviderStub(ch)
            for mid, cluster, why in (("m1", "boom", "substrate said no"), ("m2", "never-ready", "node readiness")):
                await s.Create(pb.CreateRequest(machine_id=mid))
                await wait_state(s, mid, pb.MACHINE_STATE_IDLE)
                await s.Configure(pb.ConfigureRequest(machine_id=mid, cluster_id=cluster))
                m = await wait_state(s, mid, pb.MACHINE_STATE_FAILED)
                assert why in m.last_error
    finally:
        await running.stop()


async def test_status_codes_on_the_wire() -> None:
    running = await serve(NoDelete())
    try:
        async with insecure_channel(f"127.0.0.1:{running.port}") as ch:
            s = pbg.CapacityProviderStub(ch)

            async def code(coro: object) -> grpc.StatusCode:
                try:
                    await coro  # type: ignore[misc]
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

            assert await code(s.Get(pb.MachineRef(id=""))) == grpc.StatusCode.INVALID_ARGUMENT
            assert await code(s.Get(pb.MachineRef(id="zz"))) == grpc.StatusCode.NOT_FOUND
            # no Delete: UNIMPLEMENTED before fencing, even for a replayed token
            for _ in range(2):
                req = pb.DeleteRequest(machine_id="m0", shard_id="s", shard_epoch=1, sequence_number=1)
                assert await code(s.Delete(req)) == grpc.StatusCode.UNIMPLEMENTED
            for bad in ("", "c\n1", "c 1", "c\x00"):
                assert await code(s.Configure(pb.ConfigureRequest(machine_id="m0", cluster_id=bad))) == \
                    grpc.StatusCode.INVALID_ARGUMENT, bad
            assert await code(s.Drain(pb.DrainRequest(machine_id="m0", grace_period_seconds=-1))) == \
                grpc.StatusCode.INVALID_ARGUMENT
            assert await code(s.List(pb.ListFilter(states=[42]))) == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[list-item]
            big = {f"k{i}": "v" * 1024 for i in range(9 * 1024)}
            assert await code(s.Configure(pb.ConfigureRequest(machine_id="m0", cluster_id="c", shard_metadata=big))) \
                == grpc.StatusCode.INVALID_ARGUMENT
            assert running.provider.core.rev == 4  # nothing above changed anything
            # 32 concurrent calls are all served
            calls = [s.Create(pb.CreateRequest(machine_id=f"m{i % 4}")) for i in range(16)]
            calls += [s.List(pb.ListFilter()) for _ in range(16)]
            out = await asyncio.gather(*calls)
            assert len({a.operation_id for a in out[:16]}) == 4
    finally:
        await running.stop()


async def test_memstore_restart_recovers_interrupted() -> None:
    store = MemStore()
    backend = Scripted()
    first = await serve(backend, store=store, options=KitOptions(stop_grace=0))
    async with insecure_channel(f"127.0.0.1:{first.port}") as ch:
        s = pbg.CapacityProviderStub(ch)
        await s.Create(pb.CreateRequest(machine_id="m0", shard_id="s", shard_epoch=1, sequence_number=5))
        await wait_state(s, "m0", pb.MACHINE_STATE_IDLE)
        await s.Configure(pb.ConfigureRequest(machine_id="m0", cluster_id="stubborn", shard_metadata={"a": "b"}))
    await first.stop(grace=0)
    backend.release.set()  # let the stubborn backend call end so the loop can close
    second = await serve(Scripted(n=9), store=store)
    try:
        core = second.provider.core
        assert len(core.machines) == 4  # reloaded, not re-seeded
        rec = core.machines["m0"]
        assert rec.state.name == "FAILED" and "interrupted" in rec.last_error and rec.shard_metadata == {"a": "b"}
        assert core.fences[("s", "m0")] == (1, 5) and core.next_op == 3
    finally:
        await second.stop()


async def test_invalid_describe_refuses_to_start() -> None:
    class Bad(Scripted):
        async def describe(self) -> list[Instance]:
            return [Instance("x", "t", "z", CapacityType.ON_DEMAND, math.inf)]

    with pytest.raises(InvalidRecord):
        await serve(Bad())


async def test_filestore_journal_replay_torn_line_and_compaction(tmp_path: Path) -> None:
    path = tmp_path / "s" / "state.json"
    store = FileStore(path, compact_bytes=4096)
    running = await serve(SimulatedCloud(build_catalog(20)), store=store)
    async with insecure_channel(f"127.0.0.1:{running.port}") as ch:
        s = pbg.CapacityProviderStub(ch)
        for i, m in enumerate(sorted(running.provider.core.machines)):
            await s.Create(pb.CreateRequest(machine_id=m, shard_id="s", shard_epoch=1, sequence_number=i + 1))
        await running.provider.wait_transitions(10)
        await s.List(pb.ListFilter())
    expected = running.provider.core.snapshot()
    await running.stop()
    assert store.saves >= 2 and store.appends >= 1  # compaction happened, and deltas were journaled
    with open(store.journal_path, "ab") as f:
        f.write(b'{"changes": 99999, "rev": 1, "machi')  # torn write at a crash
    core = ProviderCore()
    core.restore(FileStore(path).load() or {})
    assert core.snapshot() == expected
    # a corrupt line in the middle is an error, not silently skipped
    lines = store.journal_path.read_bytes().split(b"\n")
    if len(lines) > 3:
        store.journal_path.write_bytes(b"\n".join([lines[0], b"garbage", *lines[1:]]))
        with pytest.raises(ValueError):
            FileStore(path).load()


async def test_metrics_are_exposed() -> None:
    reg = CollectorRegistry()
    running = await serve(Scripted(), registry=reg)
    try:
        async with insecure_channel(f"127.0.0.1:{running.port}") as ch:
            s = pbg.CapacityProviderStub(ch)
            await s.Create(pb.CreateRequest(machine_id="m0"))
            await wait_state(s, "m0", pb.MACHINE_STATE_IDLE)
        text = generate_latest(reg).decode()
        assert 'bigfleet_provider_rpcs_total{code="OK",method="Create"} 1.0' in text
        assert 'bigfleet_provider_machines{state="IDLE"} 1.0' in text
        assert 'bigfleet_provider_transitions_total{kind="create",outcome="success"} 1.0' in text
    finally:
        await running.stop()


def test_state_file_is_plain_json(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "x.json")
    core = ProviderCore()
    core.seed(build_catalog(3))
    store.save(core.snapshot())
    data = json.loads((tmp_path / "x.json").read_text())
    assert set(data) >= {"machines", "fences", "ops", "rev", "next_op"} and len(data["machines"]) == 3


async def test_simulated_cloud_dwell_and_fault_rules() -> None:
    from bigfleet.provider.fake.backend import Dwell, FaultPlan, FaultRule
    from bigfleet.provider.kit.model import Kind

    plan = FaultPlan([
        FaultRule("fail", cluster="bad"),
        FaultRule("hang", label=("bigfleet.fake/billing", "spot"), kinds=frozenset({Kind.CREATE})),
    ])
    cloud = SimulatedCloud(build_catalog(4), dwell=Dwell(create=0.05), faults=plan)
    running = await serve(cloud, options=KitOptions(create_timeout=0.4))
    try:
        async with insecure_channel(f"127.0.0.1:{running.port}") as ch:
            s = pbg.CapacityProviderStub(ch)
            machines = (await s.List(pb.ListFilter())).machines
            spot = next(m.id for m in machines if m.capacity_type == pb.CAPACITY_TYPE_SPOT)
            od = next(m.id for m in machines if m.capacity_type == pb.CAPACITY_TYPE_ON_DEMAND)
            t0 = asyncio.get_running_loop().time()
            await s.Create(pb.CreateRequest(machine_id=od))
            await s.Create(pb.CreateRequest(machine_id=spot))
            assert (await s.Get(pb.MachineRef(id=od))).state == pb.MACHINE_STATE_CREATING  # dwell in progress
            await wait_state(s, od, pb.MACHINE_STATE_IDLE)
            assert asyncio.get_running_loop().time() - t0 >= 0.05
            m = await wait_state(s, spot, pb.MACHINE_STATE_FAILED)
            assert "timed out" in m.last_error
            await s.Configure(pb.ConfigureRequest(machine_id=od, cluster_id="bad"))
            m = await wait_state(s, od, pb.MACHINE_STATE_FAILED)
            assert "simulated configure failure" in m.last_error
            assert cloud.calls[Kind.CREATE] == 2
    finally:
        await running.stop()


async def test_reconcile_refreshes_prices_and_adds_machines() -> None:
    cloud = SimulatedCloud(build_catalog(3))
    running = await serve(cloud)
    try:
        rev = running.provider.core.rev
        first = cloud.catalog[0]
        first.price_per_hour = 7.5
        cloud.catalog.append(Instance("new-0", "t", "z", CapacityType.ON_DEMAND, 1.0))
        assert await running.provider.reconcile() == 2
        async with insecure_channel(f"127.0.0.1:{running.port}") as ch:
            s = pbg.CapacityProviderStub(ch)
            lst = await s.List(pb.ListFilter(since_revision=str(rev).encode()))
            got = {m.id: m.price_per_hour for m in lst.machines}
            assert got == {first.id: 7.5, "new-0": 1.0}
        assert await running.provider.reconcile() == 0
    finally:
        await running.stop()


async def test_undecodable_request_is_invalid_argument() -> None:
    running = await serve(Scripted())
    try:
        async with insecure_channel(f"127.0.0.1:{running.port}") as ch:
            raw = ch.unary_unary("/bigfleet.v1alpha1.CapacityProvider/Create")
            # field 1 (machine_id) carrying invalid UTF-8, then a truncated varint
            for payload in (b"\x0a\x02\xff\xfe", b"\x20\xff"):
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await raw(payload)
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert running.provider.core.rev == 4
    finally:
        await running.stop()
