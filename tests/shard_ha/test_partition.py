"""A paused (partitioned) leader is fenced out when it resumes; a restarted follower catches up."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from functools import partial

import grpc
import pytest
from grpc_health.v1 import health_pb2

from .group import Group, Operator, Replica, need, until

pytestmark = pytest.mark.slow

REDIRECT = "bigfleet-redirect"


async def _redirect(target: str) -> str:
    async with Operator(target, "probe") as op:
        await asyncio.wait_for(op.done.wait(), 10)
    assert op.error is not None and op.error.code() == grpc.StatusCode.UNAVAILABLE, op.error
    return str(dict(op.error.trailing_metadata() or ()).get(REDIRECT, ""))


async def _health(r: Replica, status: int) -> bool:
    return bool(await r.health() == status)


async def _configured(g: Group, n: int) -> bool:
    ms = await g.machines()
    return sum(1 for m in ms if m.cluster and m.state == 5) >= n and not any(m.state in (2, 4) for m in ms)


async def _acked_or_refused(op: Operator) -> bool:
    return bool(op.acks) or op.error is not None


async def _acked(op: Operator, n: int = 1) -> bool:
    return len(op.acks) >= n


async def test_paused_leader_is_fenced_and_steps_down() -> None:
    g = await Group(("--seed-count", "16", "--create-delay", "1.5"), with_spy=True).start()
    ok = False
    ops: list[Operator] = []
    try:
        old = await g.leader()
        ops = [Operator(old.listen, c) for c in ("c0", "c1")]
        for op in ops:
            await op.__aenter__()
            await op.rollup([need("1", count=2), need("2", priority=200)])
        for op in ops:
            await until(partial(_acked, op), 30, "roll-up ack")
        old_epoch = ops[0].acks[-1].shard_epoch
        await until(lambda: _creating(g), 30, "Creates in flight")
        assert old.proc is not None
        old.proc.signal(signal.SIGSTOP)  # a partition: alive, holding its sessions, silent
        try:
            # On a loaded box the first elected replica can lose its term before the operators
            # reach it (they are then told "not the shard leader"): find the leader again.
            deadline = time.monotonic() + 60
            while True:
                new = await g.leader(timeout=30, exclude=old)
                new_ops = [Operator(new.listen, c) for c in ("c0", "c1")]
                for op in new_ops:
                    await op.__aenter__()
                ops += new_ops
                for op in new_ops:
                    await until(partial(_acked_or_refused, op), 30, "ack from the new leader")
                refused = [op.error for op in new_ops if not op.acks]
                if not refused:
                    break
                assert time.monotonic() < deadline, f"no replica kept the lead: {refused}"
            for op in new_ops:
                assert op.acks[-1].shard_epoch > old_epoch
            await until(partial(_configured, g, 4), 60, "new leader configured the demand")
        finally:
            old.proc.signal(signal.SIGCONT)
        resumed = time.monotonic()
        # The old replica steps down: NOT_SERVING, and it points operators at the new leader.
        await until(partial(_health, old, health_pb2.HealthCheckResponse.NOT_SERVING), 20, "old leader NOT_SERVING")
        assert await until(partial(_redirect, old.listen), 20, "redirect from the old leader") == new.listen
        # Cycles go on under the group's leader. (On a loaded box the resumed replica's return can
        # cost the new leader its term -- seen once in CI: the next leader is then the one to watch.)
        await until(partial(_leader_progressed, g, old, {}, 5), 60, "five more cycles on the leader")
        late = [x for x in g.spy.calls if x.epoch == old_epoch and x.at >= resumed and x.rpc != "Get"]
        new_touched = {x.machine_id for x in g.spy.calls if x.epoch > old_epoch and x.code == grpc.StatusCode.OK}
        print(f"late calls from the deposed leader: {[(x.rpc, x.machine_id, x.code.name) for x in late]}")
        # Any late mutation on a machine the new leader had acted on was refused by fencing.
        for x in late:
            if x.machine_id in new_touched:
                assert x.code == grpc.StatusCode.FAILED_PRECONDITION, x
        if any(x.code == grpc.StatusCode.FAILED_PRECONDITION for x in late):
            # The refusal is logged; it deposes the replica unless Raft did so first (the resumed
            # replica's lost leadership and its late Creates' answers race, seen in a full run).
            logs = old.logs()
            assert "fenced by provider (zombie shard?)" in logs
            assert "fenced by the provider: a newer epoch acted" in logs or "reason='lost raft leadership'" in logs
        machines = await g.machines()
        per_cluster = Counter(m.cluster for m in machines if m.cluster)
        assert per_cluster == {"c0": 2, "c1": 2}, per_cluster
        assert not [m for m in machines if m.state in (6, 7, 8)]
        ok = True
    finally:
        for op in ops:
            await op.__aexit__()
        await g.close(dump=not ok)


async def test_restarted_follower_catches_up_and_can_lead() -> None:
    g = await Group(("--seed-count", "8",)).start()
    ok = False
    try:
        leader = await g.leader()
        follower = next(r for r in g.replicas if r is not leader)
        assert follower.proc is not None
        follower.proc.stop()
        async with Operator(leader.listen, "c0") as op:  # written while the follower is down
            await op.rollup([need("1"), need("2", priority=200), need("1", priority=300)])
            await until(partial(_acked, op), 30, "roll-up ack")
        follower.start()  # same data dir: journal and snapshot, then the entries it missed
        want = await until(lambda: leader.metric("bigfleet_shard_ha_replaces_applied"), 30, "leader metric")
        assert want >= 1
        await until(lambda: _metric_is(follower, "bigfleet_shard_ha_replaces_applied", want), 30,
                    "restarted follower applied every Replace")
        assert await follower.metric("bigfleet_shard_ha_replicated_clusters") == 1
        await until(lambda: _redirect_ok(follower, leader), 60, "restarted follower knows the leader")
        assert leader.proc is not None
        leader.proc.kill()
        new = await g.leader(timeout=30, exclude=leader)
        await until(lambda: _needs(new, 3), 60, "demand on the new leader")
        ok = True
    finally:
        await g.close(dump=not ok)


async def _metric_is(r: Replica, name: str, want: float) -> bool:
    return await r.metric(name) == want


async def _redirect_ok(f: Replica, leader: Replica) -> bool:
    return await _redirect(f.listen) == leader.listen


async def _needs(r: Replica, n: int) -> bool:
    await r.cycle()
    return await r.needs() == n


async def _creating(g: Group) -> bool:
    return any(m.state == 2 for m in await g.machines())


async def _cycle_at(r: Replica, n: int) -> bool:
    return await r.cycle() >= n


async def _leader_progressed(g: Group, old: Replica, seen: dict[str, int], n: int) -> bool:
    """True once the replica leading now (other than ``old``) ran ``n`` cycles since first seen here."""
    try:
        leader = await g.leader(timeout=5, exclude=old)
        cycle = await leader.cycle()
    except (grpc.aio.AioRpcError, TimeoutError):
        return False
    return cycle >= seen.setdefault(leader.listen, cycle) + n


async def test_new_empty_replica_joins_through_membership_change() -> None:
    import subprocess
    import sys
    from pathlib import Path

    from .group import PASSWORD

    g = await Group(("--seed-count", "0",)).start()
    ok = False
    newcomer: Replica | None = None
    try:
        leader = await g.leader()
        async with Operator(leader.listen, "c0") as op:
            await op.rollup([need("1"), need("2", priority=200)])
            await until(partial(_acked, op), 30, "roll-up ack")
        rafts = [r.raft for r in g.replicas]
        newcomer = Replica("r3", leader.provider, rafts)
        admin = str(Path(sys.executable).with_name("syncobj_admin"))
        # pysyncobj: the leader adds the node first, then the node starts with every peer listed.
        out = await asyncio.to_thread(subprocess.run, [admin, "-conn", leader.raft, "-pass", PASSWORD,
                                                       "-add", newcomer.raft], capture_output=True, text=True,
                                      timeout=30)
        assert "SUCCESS" in out.stdout, out.stdout + out.stderr
        newcomer.peers_raft = [*rafts, newcomer.raft]
        g.replicas.append(newcomer)
        newcomer.start()
        want = await until(lambda: leader.metric("bigfleet_shard_ha_replaces_applied"), 30, "leader metric")
        await until(lambda: _metric_is(newcomer, "bigfleet_shard_ha_replaces_applied", want), 60,
                    "the new replica holds every Replace")
        assert await newcomer.metric("bigfleet_shard_ha_replicated_clusters") == 1
        assert await until(partial(_redirect, newcomer.listen), 30, "redirect from the new replica") == leader.listen
        ok = True
    finally:
        await g.close(dump=not ok)
