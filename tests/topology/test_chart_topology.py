"""The Helm chart's topology as real processes: 3 coordinator replicas, ONE fake provider (behind a
recording spy), 2 shards x 3 Raft replicas (shard-0 ``--ownership exclusive``, shard-1 ``--ownership
shared``, both ``--coordinator``), and operator stand-ins that find their shard through the
coordinator and follow ``bigfleet-redirect``.

The pool is 7 committed (IDLE, 8 vCPU) hosts; demand comes in 7 vCPU units, one per machine. Three
clusters, picked by rendezvous preference: L (priority 100) and M (500) bound to shard-0 before
shard-1 exists (M prefers shard-1, so a rebalance plan moves it), H (1000) bound to shard-1.

Stages (one fleet, one scenario; stages 2 and 3 only with ``BIGFLEET_TOPOLOGY_FULL=1``):

1. Contention: L takes 4 and M 1 of shard-0's pool; H on shard-1 (no supply of its own) asks for 2
   and gets shard-0's two free hosts by a tier-1 transfer; H asks for a 3rd with shard-0 out of free
   hosts and gets one of L's by a tier-2 cross-shard drain (L's operator is told first).
2. Failover: kill -9 of shard-0's leader while it drains one of L's machines; SIGSTOP of shard-0's
   leader until the new leader has Configured a machine (M's new demand), then SIGCONT.
3. ``bigfleetctl rebalance --plan/--apply`` moves M from shard-0 to shard-1 on the same machines.
4. Pause: ``SetActuation(paused=True)`` on shard-0's leader, kill -9 of that leader; the new leader
   reports paused and makes no provider call while L's demand shrinks. Then, still paused, H asks for
   one more machine: the coordinator's tier 2 sends shard-0 a CrossShardDrain, which a paused shard
   must not carry out either (today it does: a product bug; the test records it, finishes every
   other check and ends XFAIL naming it). Resume: L is reclaimed and H served.

Checked throughout from the spy's record and the operators' frames: no machine FAILED; no Drain of a
Configured machine before its operator received a ReclaimInstruction naming it; per machine, the
shard issuing lifecycle calls changes only through a coordinator transfer to that shard (and never
overlaps); at the end every cluster has exactly its demand CONFIGURED.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from bigfleet.coordclient.client import CoordinatorClient
from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.placement.hrw import preferred
from bigfleet.rpc import insecure_channel
from bigfleet.shard.handoff import OWNER_KEY
from bigfleet.testing import ManagedProcess, free_port, wait_for_health
from bigfleet.v1alpha1 import shard_pb2, shard_pb2_grpc

from .fleet import (
    Fleet,
    RoutedOperator,
    S,
    ShardGroup,
    start_spy,
    until,
    violations,
)

pytestmark = [pytest.mark.slow, pytest.mark.topology]

FULL = os.environ.get("BIGFLEET_TOPOLOGY_FULL", "") not in ("", "0")
S0, S1 = "shard-0", "shard-1"
POOL = 7
# 7 of a host's 7.5 allocatable vCPU: each unit of demand is exactly one machine (the engine covers a
# need's aggregate with whole machines that each fit min_unit).
UNIT = "7"
LOW, MID, HIGH = 100, 500, 1000
SHARD_ARGS = ("--heartbeat-interval", "0.3", "--cycle-interval", "0.3", "--min-cycle-gap", "0.05",
              "--reconcile-interval", "0.3")
COORD_ARGS = ("--rebalance-interval", "0.5", "--transfer-cooldown", "1", "--log-level", "info")
PROVIDER_ARGS = ("--seed-count", "0", "--committed-count", str(POOL), "--configure-delay", "0.5",
                 "--drain-delay", "1.0")


def pick(prefix: str, want: str) -> str:
    """A cluster id whose rendezvous-preferred shard (of shard-0 and shard-1) is ``want``."""
    return next(c for c in (f"{prefix}-{i}" for i in range(200)) if preferred(c, [S0, S1]) == want)


L = pick("low", S0)
M = pick("mid", S1)
H = pick("high", S1)


def ctl(coord: list[str], *args: str) -> Any:
    out = subprocess.run([sys.executable, "-m", "bigfleet.ctl.main", "--coordinator", ",".join(coord),
                          "--timeout", "20", "-o", "json", *args],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return json.loads(out)


class Scenario:
    def __init__(self, fleet: Fleet, t0: float) -> None:
        self.f = fleet
        self.demand: dict[str, int] = {}
        self.timings: list[tuple[str, float]] = []
        self.bugs: list[str] = []  # product bugs seen (the test ends XFAIL naming them)
        self._t0 = t0

    def lap(self, what: str) -> None:
        self.timings.append((what, round(time.monotonic() - self._t0, 1)))

    @property
    def g0(self) -> ShardGroup:
        return self.f.groups[S0]

    @property
    def g1(self) -> ShardGroup:
        return self.f.groups[S1]

    def op(self, cluster: str) -> RoutedOperator:
        return self.f.operators[cluster]

    def set_demand(self, cluster: str, n: int) -> None:
        self.demand[cluster] = n
        self.op(cluster).set_count(n)

    async def converge(self, what: str, timeout: float = 120) -> None:
        await until(lambda: self.f.settled(self.demand), timeout, f"{what}: want {self.demand}", interval=0.2)

    async def machines_of(self, cluster: str) -> list[Any]:
        return [m for m in await self.f.spy.machines() if m.cluster == cluster]

    async def done(self, kind: str, frm: str, to: str) -> list[Any]:
        return [t for t in await self.f.transfers() if t.kind == kind and t.phase == "done"
                and (t.from_shard_id, t.to_shard_id) == (frm, to) and t.machine_ids]

    def check(self) -> None:
        """The running invariants, on everything recorded so far."""
        assert not [u for op in self.f.operators.values() for u in op.failed_updates()], "a machine went FAILED"

    async def check_record(self) -> dict[str, int]:
        stats: dict[str, int] = {}
        bad = violations(self.f.spy, self.f.operators.values(), await self.f.transfers(), stats)
        assert not bad, "\n".join(bad)
        return stats


async def start(tmp_path: Path) -> tuple[Fleet, Scenario]:
    """Everything up; L and M bound to shard-0 before shard-1 registers, H bound to shard-1."""
    t0 = time.monotonic()
    root = tmp_path
    (root / "logs").mkdir(parents=True, exist_ok=True)
    coord = CoordGroup(root / "coord", 3, extra=COORD_ARGS)
    await asyncio.to_thread(coord.start_all, False)
    paddr = f"127.0.0.1:{free_port()}"
    prov = ManagedProcess.bigfleet(["fake-provider", "--listen", paddr, "--log-format", "console", *PROVIDER_ARGS],
                                   "provider", log_dir=root / "logs").start()
    spy, server, spy_addr = await start_spy(paddr)
    f = Fleet(root, coord, prov, spy, server, spy_addr)
    f.client = CoordinatorClient(coord.addresses, timeout=10)
    try:
        for sid, mode in ((S0, "exclusive"), (S1, "shared")):
            f.groups[sid] = ShardGroup(sid, mode, spy_addr, coord.addresses, root, extra=SHARD_ARGS)
        f.groups[S0].start()
        await asyncio.to_thread(wait_for_health, paddr, 60)
        await asyncio.to_thread(coord.wait_up, 60)
        await until(lambda: _registered(f, S0), 90, "shard-0 registered with the coordinator")
        # Bound while shard-0 is the only live shard: both land there (M would prefer shard-1).
        assert await f.binding(L) == S0 and await f.binding(M) == S0
        f.groups[S1].start()
        sc = Scenario(f, t0)
        f.operators[L] = RoutedOperator(coord.addresses, L, cpu=UNIT, priority=LOW).start()
        f.operators[M] = RoutedOperator(coord.addresses, M, cpu=UNIT, priority=MID).start()
        sc.set_demand(L, 4)
        sc.set_demand(M, 1)
        await until(lambda: _registered(f, S1), 90, "shard-1 registered with the coordinator")
        assert await f.binding(H) == S1
        sc.lap("fleet up")
        return f, sc
    except BaseException:
        f.dump()
        await f.close()
        raise


async def _registered(f: Fleet, sid: str) -> bool:
    addr = (await f.shards()).get(sid, "")
    g = f.groups[sid]
    r = g.by_address(addr)
    return r is not None and await r.serving()


# --------------------------------------------------------------------------- stages
async def stage_contention(sc: Scenario) -> None:
    f = sc.f
    await sc.converge("L and M served from shard-0's pool", 120)
    sc.lap("L=4, M=1 configured on shard-0")

    # H's operator starts from a stale cached address, a shard-1 follower: it must reach the leader
    # through the follower's bigfleet-redirect.
    lead1 = await sc.g1.leader()
    follower = next(r for r in sc.g1.replicas if r is not lead1)
    hint = await until(lambda: _redirect_hint(follower.listen, "probe"), 60, "a shard-1 follower naming its leader")
    assert sc.g1.by_address(hint) is not None, hint
    f.operators[H] = RoutedOperator(f.coord.addresses, H, cpu=UNIT, priority=HIGH, cached=follower.listen).start()
    # Tier 1: shard-0 has two free hosts; shard-1 has none of its own.
    sc.set_demand(H, 2)
    await sc.converge("H served on shard-1 through a tier-1 transfer", 120)
    first = [(t, how) for _at, t, how in sc.op(H).sessions[:2]]
    # (the leader named is normally lead1; on a loaded box shard-1 may have elected another meanwhile)
    assert first[0] == (follower.listen, "cached") and first[1][1] == "redirect" and f.shard_of(first[1][0]) == S1, (
        first, lead1.listen)
    tier1 = await sc.done("inventory", S0, S1)
    moved = {mid for t in tier1 for mid in t.machine_ids}
    h_machines = await sc.machines_of(H)
    assert {m.id for m in h_machines} <= moved, (h_machines, tier1)
    assert {m.shard_metadata.get(OWNER_KEY) for m in h_machines} == {S1}
    sc.lap("tier 1: H=2 on hosts moved from shard-0")
    sc.check()

    # Tier 2: shard-0 has no free host left; H (1000) outranks L (100) and M (500).
    victims_before = {m.id for m in await sc.machines_of(L)}
    t_tier2 = time.monotonic()
    sc.set_demand(H, 3)
    sc.demand[L] = 3  # what the pool can still give L (its operator keeps asking for 4 meanwhile)
    await sc.converge("H's third machine drained from L on shard-0 (tier 2)", 180)
    tier2 = await sc.done("drain", S0, S1)
    assert tier2, await f.transfers()
    taken = {mid for t in tier2 for mid in t.machine_ids}
    assert taken <= victims_before and taken <= {m.id for m in await sc.machines_of(H)}
    told = [fr.msg.reclaim_instruction for fr in sc.op(L).reclaims(since=t_tier2)]
    assert told and all(ri.preemptor_priority == HIGH for ri in told), told
    assert not sc.op(M).reclaims() and not sc.op(H).reclaims()
    sc.set_demand(L, 3)
    sc.lap("tier 2: H=3, one host drained from L")
    sc.check()
    await sc.check_record()


async def stage_failover(sc: Scenario) -> None:
    f = sc.f
    g0 = sc.g0
    # kill -9 of shard-1's leader: the new leader owns H's machines (adopted through transfers, in
    # the replicated ledger, and marked shard-1) and touches nothing.
    lead1 = await sc.g1.leader()
    t = time.monotonic()
    assert lead1.proc is not None
    lead1.proc.kill()
    new1 = await sc.g1.leader(timeout=60, exclude=[lead1])
    await until(lambda: _bound(new1, H, sc.demand[H]), 60, "shard-1's new leader holding H's machines")
    assert (await new1.counts()).total == sc.demand[H]
    await until(lambda: sc.op(H).acked_rollup(new1.listen, t), 60, "H's operator on shard-1's new leader")
    assert not f.spy.mutating(since=t), [(c.rpc, c.machine_id, c.shard_id) for c in f.spy.mutating(since=t)]
    lead1.start()
    sc.lap("kill -9 of shard-1's leader: H kept its machines")
    # kill -9 of shard-0's leader while it drains one of L's machines.
    t = time.monotonic()
    sc.set_demand(L, 2)
    drain = await until(lambda: [c for c in f.spy.mutating(S0, since=t, ok_only=True) if c.rpc == "Drain"],
                        60, "shard-0 draining one of L's machines")
    leader = await g0.leader()
    epoch = (await leader.counts()).shard_epoch
    assert drain[0].epoch == epoch  # the replica about to be killed is the one draining
    assert leader.proc is not None
    leader.proc.kill()
    t_kill = time.monotonic()
    new = await g0.leader(timeout=60, exclude=[leader])
    sc.lap(f"kill -9 of shard-0's leader mid-drain; new leader after {time.monotonic() - t_kill:.1f}s")
    await sc.converge("L back to 2 after the failover", 120)
    assert (await new.counts()).shard_epoch > epoch
    leader.start()  # the pod comes back (same data dir) as a follower
    await until(lambda: _health_is(leader, health_pb2.HealthCheckResponse.NOT_SERVING), 60, "restarted replica up")
    sc.check()

    # SIGSTOP of shard-0's leader until a new leader has acted (Configured M's second machine).
    stopped = await g0.leader()
    ep_stopped = (await stopped.counts()).shard_epoch
    assert stopped.proc is not None
    stopped.proc.signal(signal.SIGSTOP)
    stopped.stopped = True
    t_stop = time.monotonic()
    try:
        sc.set_demand(M, 2)
        acted = await until(lambda: [c for c in f.spy.mutating(S0, since=t_stop, ok_only=True)
                                     if c.epoch > ep_stopped and c.rpc == "Configure" and c.cluster == M],
                            120, "a new shard-0 leader configuring M's second machine")
        sc.lap(f"SIGSTOP: new leader acted {acted[0].t0 - t_stop:.1f}s after the stop")
    finally:
        stopped.proc.signal(signal.SIGCONT)
        stopped.stopped = False
    t_cont = time.monotonic()
    await until(lambda: _health_is(stopped, health_pb2.HealthCheckResponse.NOT_SERVING), 30,
                "the resumed replica stepped down")
    await sc.converge("M=2 after the SIGSTOP", 120)
    late = [c for c in f.spy.mutating(S0, since=t_cont) if c.epoch == ep_stopped]
    newer = {c.machine_id for c in f.spy.mutating(S0, since=t_stop, ok_only=True) if c.epoch > ep_stopped}
    print(f"late calls from the resumed leader: {[(c.rpc, c.machine_id, c.code.name) for c in late]}")
    for c in late:
        assert not (c.ok and c.machine_id in newer), f"deposed leader's {c.rpc} on {c.machine_id} accepted"
    sc.check()
    await sc.check_record()


async def stage_move(sc: Scenario) -> None:
    f = sc.f
    coord = f.coord.addresses
    m_ids = {m.id for m in await sc.machines_of(M)}
    plan = await asyncio.to_thread(ctl, coord, "rebalance", "--plan")
    assert [(m["cluster_id"], m["from"], m["to"]) for m in plan["moves"]] == [(M, S0, S1)], plan
    t_apply = time.monotonic()
    applied = await asyncio.to_thread(ctl, coord, "rebalance", "--apply", "--plan-id", plan["plan_id"])
    assert len(applied["started"]) == 1, applied
    op = sc.op(M)

    def on_shard1() -> bool:
        return any(f.shard_of(fr.target) == S1 and fr.at >= t_apply and fr.msg.ack.echo == "rollup"
                   for fr in op.of("ack"))

    await until(on_shard1, 120, "M's operator served by shard-1")
    assert await f.binding(M) == S1
    # shard-0 closed M's session naming shard-1 (the operator followed that redirect or a lookup).
    assert any(code == "FAILED_PRECONDITION" and "->" in why for at, _t, code, why in op.ended if at >= t_apply), op.ended
    await sc.converge("M still on its two machines", 60)
    assert {m.id for m in await sc.machines_of(M)} == m_ids
    assert not [c for c in f.spy.mutating(since=t_apply) if c.machine_id in m_ids], "the move touched M's machines"
    leader1 = await sc.g1.leader()
    await until(lambda: _bound(leader1, M, len(m_ids)), 30, "shard-1 counting M's machines")
    sc.lap("M moved shard-0 -> shard-1")
    sc.check()
    await sc.check_record()


async def stage_pause(sc: Scenario) -> None:
    f = sc.f
    g0 = sc.g0
    await sc.converge("quiet before the pause", 60)
    lead = await g0.leader()
    st = await lead.set_actuation(True, "topology test")
    assert st.paused
    t_pause = time.monotonic()
    assert lead.proc is not None
    lead.proc.kill()
    new = await g0.leader(timeout=60, exclude=[lead])
    assert (await new.actuation()).paused, "the pause did not survive the failover"
    sc.lap("paused shard-0 leader killed; the new leader reports paused")
    n_low = sc.demand[L]
    t_change = time.monotonic()
    sc.set_demand(L, n_low - 1)
    sc.demand[L] = n_low  # nothing may change while paused
    await until(lambda: sc.op(L).acked_rollup(new.listen, t_change), 60, "the new leader acking L's smaller roll-up")
    c0 = (await new.actuation()).cycle
    await until(lambda: _cycle_at_least(new, c0 + 10), 60, "ten cycles on the paused leader")
    lead.start()
    assert not f.spy.mutating(S0, since=t_pause), [(c.rpc, c.machine_id) for c in f.spy.mutating(S0, since=t_pause)]
    assert not sc.op(L).reclaims(since=t_pause)
    assert await f.settled(sc.demand)
    sc.lap("paused: no provider call, no reclaim over ten cycles")

    # While shard-0 is paused, H (shard-1) wants one more machine and nobody has a free one: the
    # coordinator's tier 2 asks shard-0 to drain one of L's. A paused shard must not act on it.
    t_probe = time.monotonic()
    sc.set_demand(H, sc.demand[H] + 1)
    sc.demand[H] -= 1  # nothing may change while paused
    asked = await until(lambda: _drain_started(sc, S0, S1, t_probe), 60, "a tier-2 drain asked of paused shard-0")
    with contextlib.suppress(TimeoutError):  # long enough for a drain (reclaim + 1 s provider drain) to show
        await until(lambda: f.spy.mutating(S0, since=t_pause), 8, "a call from paused shard-0")
    calls = [(c.rpc, c.machine_id, f"{c.shard_id}@{c.epoch}", c.code.name) for c in f.spy.mutating(S0, since=t_pause)]
    reclaims = [list(fr.msg.reclaim_instruction.nodes) for fr in sc.op(L).reclaims(since=t_pause)]
    if calls or reclaims:
        # Known product bug (reported, not fixed here): ShardHandoff.cross_shard_drain drains through
        # Executor.submit_drain, which never looks at the actuation switch. Recorded, and the test
        # ends XFAIL after every other check has passed (see scenario()).
        sc.bugs.append(
            f"paused shard-0 (GetActuation paused=True) carried out coordinator CrossShardDrain "
            f"{[t.transfer_id for t in asked]}: provider calls {calls}, ReclaimInstructions to {L} {reclaims}")
        await until(lambda: _drain_done(sc, [t.transfer_id for t in asked]), 60, "the drain transfer to end")
        sc.lap("paused: BUG - a coordinator cross-shard drain acted")
    else:
        sc.lap("paused: a coordinator cross-shard drain did not act either")

    t_resume = time.monotonic()
    lead2 = await g0.leader()
    st = await lead2.set_actuation(False, "topology test done")
    assert not st.paused
    sc.demand[L] = n_low - 1
    sc.demand[H] += 1
    await sc.converge("L reclaimed and H served after the resume", 180)
    if not sc.bugs:  # (with the bug, the paused drain already gave L's machine to H)
        assert sc.op(L).reclaims(since=t_resume)
    sc.lap("resumed: L reclaimed")
    sc.check()


async def scenario(tmp_path: Path, full: bool) -> None:
    f, sc = await start(tmp_path)
    ok = False
    try:
        await stage_contention(sc)
        if full:
            await stage_failover(sc)
            await stage_move(sc)
        await stage_pause(sc)

        # The end: exactly the demand CONFIGURED, and it stays so.
        await sc.converge("final demand", 60)
        for g in (sc.g0, sc.g1):
            await until(lambda g=g: _cycles(g, 5), 60, f"five more cycles on {g.shard_id}")
        assert await f.settled(sc.demand), (await f.configured(), sc.demand)
        machines = await f.spy.machines()
        assert len(machines) == POOL
        assert not [m.id for m in machines if m.state == S.MACHINE_STATE_FAILED]
        for g in (sc.g0, sc.g1):
            counts = await (await g.leader()).counts()
            assert not counts.by_state.get("MACHINE_STATE_FAILED", 0), (g.shard_id, counts)
        sc.check()
        stats = await sc.check_record()
        assert stats["drains_checked"] >= 2 and stats["owner_changes_checked"] >= 1, stats
        sc.lap("end")
        print("invariant checks:", stats, "; provider calls:", len(f.spy.calls),
              "; operator sessions:", {c: [how for _a, _t, how in op.sessions] for c, op in f.operators.items()})
        print("topology timings (s):", sc.timings)
        ok = True
    finally:
        if not ok:
            print("topology timings (s):", sc.timings)
            f.dump()
        await f.close()
    if sc.bugs:
        pytest.xfail("product bug: " + "; ".join(sc.bugs))


# --------------------------------------------------------------------------- probes
async def _redirect_hint(addr: str, cluster: str) -> str:
    """The bigfleet-redirect a replica answers a Session with ('' when it serves it or names nobody)."""
    async with insecure_channel(addr) as ch:
        call = shard_pb2_grpc.ShardStub(ch).Session()
        try:
            await call.write(shard_pb2.OperatorMessage(hello=shard_pb2.Hello(cluster_id=cluster,
                                                                            protocol_version="v1alpha1")))
            await asyncio.wait_for(call.read(), 10)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return str(dict(exc.trailing_metadata() or ()).get("bigfleet-redirect", ""))
            return ""
        call.cancel()
        return ""


async def _drain_done(sc: Scenario, ids: list[str]) -> bool:
    return all(t.phase in ("done", "aborted") for t in await sc.f.transfers() if t.transfer_id in ids)


async def _drain_started(sc: Scenario, frm: str, to: str, since: float) -> list[Any]:
    wall = time.time() - (time.monotonic() - since)
    return [t for t in await sc.f.transfers() if t.kind == "drain" and (t.from_shard_id, t.to_shard_id) == (frm, to)
            and t.created_at_unix_ns / 1e9 >= wall - 0.5]


async def _health_is(r: Any, status: int) -> bool:
    try:
        return bool(await r.health() == status)
    except grpc.aio.AioRpcError:
        return False


async def _bound(r: Any, cluster: str, n: int) -> bool:
    return (await r.counts()).bound_by_cluster.get(cluster, 0) == n


async def _cycle_at_least(r: Any, n: int) -> bool:
    return (await r.actuation()).cycle >= n


_seen: dict[str, int] = {}


async def _cycles(g: ShardGroup, n: int) -> bool:
    r = await g.leader()
    c = (await r.actuation()).cycle
    return c >= _seen.setdefault(r.listen, c) + n


# --------------------------------------------------------------------------- tests
@pytest.mark.timeout(600)
@pytest.mark.skipif(FULL, reason="a subset of test_chart_topology_full (BIGFLEET_TOPOLOGY_FULL is set)")
async def test_chart_topology_contention_and_pause_failover(tmp_path: Path) -> None:
    """The default (CI) slice: stages 1 and 4."""
    await scenario(tmp_path, full=False)


@pytest.mark.timeout(900)
@pytest.mark.skipif(not FULL, reason="the full scenario runs with BIGFLEET_TOPOLOGY_FULL=1 (make test-topology)")
async def test_chart_topology_full(tmp_path: Path) -> None:
    """Every stage: contention, kill -9 and SIGSTOP of leaders, a cluster move, pause across failover."""
    await scenario(tmp_path, full=True)
