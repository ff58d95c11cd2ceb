"""One pool across providers (bigfleet.shard.providers): parsing ``--provider``, the router's id
prefixes and routing, its merged List cursor, and the reconciler's per-provider scope -- against
two in-process fake providers (the kit's real state machine) that use the *same* machine ids."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from bigfleet.observability import new_registry
from bigfleet.provider.fake.catalog import build_catalog
from bigfleet.provider.fake.sim import SimProvider, SimStub
from bigfleet.shard.daemon import DaemonConfig, ShardDaemon
from bigfleet.shard.executor import ExecutorConfig
from bigfleet.shard.handoff import OWNER_KEY
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.provider_client import ProviderClient, ProviderError
from bigfleet.shard.providers import ProviderRouter, ProviderSpec, build_provider, parse_provider_specs
from bigfleet.v1alpha1 import provider_pb2

S = provider_pb2.MachineState


class Switch:
    """A stub that forwards to a fake provider, or answers UNAVAILABLE while ``down``."""

    def __init__(self, sim: SimProvider) -> None:
        self.sim, self.inner, self.down = sim, SimStub(sim), False
        self.calls: list[tuple[str, str]] = []
        self.fence_creates = False  # answer Create with the fencing code (a newer epoch acted)

    def __getattr__(self, rpc: str) -> Any:
        async def call(req: Any, **kw: Any) -> Any:
            self.calls.append((rpc, getattr(req, "machine_id", "") or getattr(req, "id", "")))
            if self.down:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "provider down")
            if self.fence_creates and rpc == "Create":
                raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(),
                                           grpc.aio.Metadata(), "stale epoch")
            return await getattr(self.inner, rpc)(req, **kw)
        return call


def fake(committed: int, seed: int) -> SimProvider:
    return SimProvider(build_catalog(seed, committed))


def client(stub: Switch, epoch: int = 2) -> ProviderClient:
    return ProviderClient("in-process", "s1", epoch, stub=stub, max_attempts=1, backoff=0.01)


@pytest.fixture
def pair() -> tuple[ProviderRouter, Switch, Switch]:
    a, b = Switch(fake(2, 0)), Switch(fake(0, 4))  # both have ids like onprem-00000 / aws-00000
    router = ProviderRouter([(ProviderSpec("metal", "x:1"), client(a)), (ProviderSpec("cloud", "y:2"), client(b))])
    return router, a, b


def test_provider_specs_parse_and_refuse_with_the_value() -> None:
    assert parse_provider_specs("10.0.0.1:7790") == (ProviderSpec("", "10.0.0.1:7790"),)
    assert parse_provider_specs(["metal=a:1", "aws=b:2@shared"]) == (
        ProviderSpec("metal", "a:1"), ProviderSpec("aws", "b:2", "shared"))
    assert parse_provider_specs("metal=a:1,aws=[::1]:2") == (ProviderSpec("metal", "a:1"), ProviderSpec("aws", "[::1]:2"))
    for bad, why in [("a=host", "HOST:PORT"), ("h:1,b=h:2", "need a name"), ("Big=h:1", "name must"),
                     ("a=h:1,a=h:2", "twice"), ("a=h:1@mine", "exclusive or shared"), ("h:1@shared", "needs a name"),
                     ("a=h:99999", "HOST:PORT"), ("a/b=h:1", "name must")]:
        with pytest.raises(ValueError, match=why):
            parse_provider_specs(bad)


def test_one_unnamed_provider_is_used_as_is() -> None:
    made: list[str] = []

    def mk(target: str) -> ProviderClient:
        made.append(target)
        return client(Switch(fake(1, 0)))

    assert isinstance(build_provider(parse_provider_specs("h:1"), mk), ProviderClient)
    assert isinstance(build_provider(parse_provider_specs(["a=h:1", "b=h:2"]), mk), ProviderRouter)
    assert made == ["h:1", "h:1", "h:2"]


async def test_ids_are_prefixed_and_calls_route_to_the_owner(pair: tuple[ProviderRouter, Switch, Switch]) -> None:
    router, a, b = pair
    lst = await router.list()
    ids = sorted(m.id for m in lst.machines)
    assert "metal/onprem-00000" in ids and "cloud/aws-00000" in ids and "metal/aws-00000" in ids
    assert len(ids) == len(set(ids)) == 6
    # A Create goes to the provider that listed the slot, with that provider's own id; the other is untouched.
    ack = await router.create("cloud/aws-00000")
    assert ack.machine.id == "cloud/aws-00000" and ack.machine.state == S.MACHINE_STATE_CREATING
    assert b.sim.core.machines["aws-00000"].state.name == "CREATING"
    assert ("Create", "aws-00000") in b.calls and not any(c[0] == "Create" for c in a.calls)
    assert (await router.get("cloud/aws-00000")).state == S.MACHINE_STATE_CREATING
    assert (await router.get("metal/onprem-00000")).state == S.MACHINE_STATE_IDLE
    # Configure carries the shard's owner mark to the member that holds the machine.
    router.extra_metadata = {OWNER_KEY: "s1"}
    ack = await router.configure("metal/onprem-00000", "c1", b"blob", {"k": "v"})
    assert ack.machine.id == "metal/onprem-00000"
    assert a.sim.core.machines["onprem-00000"].shard_metadata[OWNER_KEY] == "s1"
    # Drain and Delete go to the holder too, with its own id.
    a.sim.advance(10_000)
    b.sim.advance(10_000)
    assert (await router.drain("metal/onprem-00000", 0)).machine.id == "metal/onprem-00000"
    assert (await router.delete("cloud/aws-00000")).machine.id == "cloud/aws-00000"
    assert ("Drain", "onprem-00000") in a.calls and not any(c[0] == "Drain" for c in b.calls)
    assert ("Delete", "aws-00000") in b.calls and not any(c[0] == "Delete" for c in a.calls)
    assert a.sim.core.machines["onprem-00000"].state.name == "DRAINING"
    assert b.sim.core.machines["aws-00000"].state.name == "DELETING"
    for bad in ("onprem-00000", "gcp/onprem-00000", "metal/"):
        with pytest.raises(ProviderError) as ei:
            await router.drain(bad, 0)
        assert ei.value.code == grpc.StatusCode.NOT_FOUND and ei.value.conflict


async def test_merged_list_keeps_a_down_members_cursor(pair: tuple[ProviderRouter, Switch, Switch]) -> None:
    router, _a, b = pair
    first = await router.list()
    assert (await router.list(first.revision)).machines == []  # nothing changed anywhere
    b.down = True
    await router.configure("metal/onprem-00000", "c1", b"blob", {})
    part = await router.list(first.revision)
    assert [m.id for m in part.machines] == ["metal/onprem-00000"]
    b.down = False
    await router.create("cloud/aws-00001")
    later = await router.list(part.revision)  # b is asked from its old cursor: its change is not lost
    assert [m.id for m in later.machines] == ["cloud/aws-00001"]
    b.down, _a.down = True, True
    with pytest.raises(ProviderError):
        await router.list(later.revision)
    b.down, _a.down = False, False
    assert len((await router.list(b"not-a-router-cursor")).machines) == 6  # unreadable: a full List, no crash


async def _daemon(router: Any, ownership: str = "exclusive") -> ShardDaemon:
    cfg = DaemonConfig(shard_id="s1", provider="metal=x:1,cloud=y:2", epoch=2, ownership=ownership,
                       executor=ExecutorConfig(execute_timeout=0.5))
    return ShardDaemon(cfg, ShardMetrics(new_registry()), provider=router)


@pytest.fixture
async def daemon(pair: tuple[ProviderRouter, Switch, Switch]) -> AsyncIterator[tuple[ShardDaemon, Switch, Switch]]:
    router, a, b = pair
    d = await _daemon(router)
    try:
        yield d, a, b
    finally:
        await d.stop(drain_timeout=0.2)


async def test_a_full_list_forgets_only_its_own_providers_machines(
        daemon: tuple[ShardDaemon, Switch, Switch]) -> None:
    d, _a, b = daemon
    await d.reconciler.initial(asyncio.Event())
    assert d.reconciled.is_set() and len(d.view) == 6
    ghost = provider_pb2.Machine()
    ghost.CopyFrom(d.view.get("metal/onprem-00000"))
    for gid in ("metal/ghost", "cloud/ghost"):
        ghost.id = gid
        d.view.observe(ghost)
    b.down = True
    with pytest.raises(ProviderError):
        await d.reconciler.reconcile(full=True)
    ids = set(d.view.ids())
    assert "metal/ghost" not in ids  # metal answered: its erased machine goes
    assert "cloud/ghost" in ids and {"cloud/aws-00000", "cloud/gcp-00000"} <= ids  # cloud's stay as last read
    reachable = d.metrics.provider_reachable
    assert reachable.labels("metal")._value.get() == 1 and reachable.labels("cloud")._value.get() == 0
    b.down = False
    await d.reconciler.reconcile(full=True)
    assert "cloud/ghost" not in set(d.view.ids()) and len(d.view) == 6


async def test_start_waits_for_every_provider_then_goes_on_with_those_that_answer(
        daemon: tuple[ShardDaemon, Switch, Switch]) -> None:
    d, _a, b = daemon
    b.down = True
    d.reconciler.initial_grace = 0.3
    await asyncio.wait_for(d.reconciler.initial(asyncio.Event()), 5)
    assert d.reconciled.is_set()
    assert {m.split("/")[0] for m in d.view.ids()} == {"metal"}
    b.down = False
    d.reconciler.interval = 0.05
    stop = asyncio.Event()
    run = asyncio.create_task(d.reconciler.run(stop))
    try:
        for _ in range(100):
            if len(d.view) == 6:
                break
            await asyncio.sleep(0.02)
        assert len(d.view) == 6 and d.reconciler.read_once == {"metal", "cloud"}
    finally:
        stop.set()
        await run


async def test_ownership_mode_holds_per_provider() -> None:
    a, b = Switch(fake(2, 0)), Switch(fake(2, 0))
    router = ProviderRouter([(ProviderSpec("own", "x:1"), client(a)),
                             (ProviderSpec("shared", "y:2", "shared"), client(b))])
    for name, sw in (("own", a), ("shared", b)):  # bound by a shard that writes no owner mark
        await router.member(name).configure("onprem-00000", "other", b"blob", {})
        sw.sim.advance(10_000)
        assert sw.sim.core.machines["onprem-00000"].state.name == "CONFIGURED"
    d = await _daemon(router, ownership="exclusive")
    try:
        await d.reconciler.initial(asyncio.Event())
        ids = set(d.view.ids())
        assert "own/onprem-00000" in ids  # exclusive provider: unmarked machines are this shard's
        assert "shared/onprem-00000" not in ids  # shared provider: they are not
        # ...nor its unbound ones: a shared provider gives a shard only what was adopted (shard/handoff.py).
        assert "shared/aws-00000" not in ids and "own/aws-00000" in ids
    finally:
        await d.stop(drain_timeout=0.2)


def test_a_malformed_provider_flag_is_a_clear_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    from bigfleet.shard.cli import main

    for argv, why in ((["--provider", "metal=host", "--provider", "aws=h:1"], "expected HOST:PORT, got 'host'"),
                      (["--provider", "h:1", "--provider", "aws=h:2"], "several providers need a name each")):
        with pytest.raises(SystemExit) as ei:
            main(argv)
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert "--provider: " in err and why in err, err


async def test_each_provider_is_fenced_with_the_epoch_and_any_fencing_answer_steps_down() -> None:
    from bigfleet.shard.ha.controller import FencedProviderClient

    a, b = Switch(fake(2, 0)), Switch(fake(0, 4))
    stubs = {"x:1": a, "y:2": b}
    fenced: list[ProviderError] = []
    router = build_provider(parse_provider_specs("metal=x:1,cloud=y:2"), lambda t: FencedProviderClient(
        "in-process", "s1", 7, stub=stubs[t], max_attempts=1, on_fenced=fenced.append))
    await router.configure("metal/onprem-00000", "c1", b"blob", {})
    await router.configure("metal/aws-00000", "c1", b"blob", {})
    await router.create("cloud/aws-00000")
    # Every call carried the shard's epoch; each provider has its own fencing sequence.
    fa, fb = a.sim.core.fences, b.sim.core.fences
    assert set(fa) == {("s1", "onprem-00000"), ("s1", "aws-00000")} and set(fb) == {("s1", "aws-00000")}
    assert {e for e, _ in [*fa.values(), *fb.values()]} == {7}
    assert sorted(q for _, q in fa.values()) == [1, 2] and [q for _, q in fb.values()] == [1]
    assert not fenced
    b.fence_creates = True
    with pytest.raises(ProviderError) as ei:
        await router.create("cloud/aws-00001")
    assert ei.value.fenced and fenced == [ei.value]  # the controller steps this replica down
