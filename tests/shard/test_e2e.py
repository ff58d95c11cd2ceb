"""End to end with real processes: fake-provider + shard subprocesses, the test as the operator.

A recording pass-through sits between the shard and the provider so the tests can see every call
(bootstrap blobs handed to Configure, fencing tokens, how often each machine was created).
"""

from __future__ import annotations

import grpc
import pytest

from bigfleet.v1alpha1 import provider_pb2
from bigfleet.wire.machine import META_NEED_FINGERPRINT

from .cluster import ShardProc, fleet
from .opsim import FakeOperator, need
from .spy import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

S = provider_pb2.MachineState
ORDER = {S.MACHINE_STATE_SPECULATIVE: 0, S.MACHINE_STATE_CREATING: 1, S.MACHINE_STATE_IDLE: 2,
         S.MACHINE_STATE_CONFIGURING: 3, S.MACHINE_STATE_CONFIGURED: 4}


async def test_demand_configures_rejects_malformed_and_reclaims() -> None:
    # (the withdrawal below is a collapse the empty-roll-up guard would hold for 30 s: its own
    # test is tests/shard/test_budget_e2e.py)
    holds = ("--spot-hold-seconds", "1", "--on-demand-hold-seconds", "1", "--no-empty-rollup-guard")
    async with fleet(("--seed-count", "4", "--committed-count", "2"), holds) as (_prov, spy, shard):  # noqa: SIM117
        async with FakeOperator(shard.addr, "c1", blob=b"join-c1-token") as op:
            await op.send_rollup([need("7", count=3)])

            async def bound3() -> bool:
                c = await shard.counts()
                return c.bound_by_cluster.get("c1", 0) == 3 and c.by_state.get("MACHINE_STATE_CONFIGURED", 0) == 3
            await until(bound3, 40, "3 machines Configured for c1")

            # The blob the operator returned went to Configure untouched, fenced with our epoch.
            configures = spy.of("Configure")
            assert len(configures) == 3
            assert {c.bootstrap_blob for c in configures} == {b"join-c1-token"}
            assert {c.cluster_id for c in configures} == {"c1"}
            tokens = [(c.shard_id, c.shard_epoch, c.sequence_number) for c in [*spy.of("Create"), *configures]]
            assert all(t[0] == "s1" and t[1] == 1 and t[2] > 0 for t in tokens)
            assert len({t[2] for t in tokens}) == len(tokens)
            assert max(spy.per_machine("Create").values(), default=0) <= 1
            # The provider's records carry the binding and the assignment metadata.
            records = {m.id: m for m in await spy.list_machines() if m.cluster == "c1"}
            assert len(records) == 3
            assert all(m.shard_metadata.get(META_NEED_FINGERPRINT) for m in records.values())

            # UpcomingNode-style updates: every bound machine ends CONFIGURED, states only move forward.
            await until(lambda: all(op.latest_node_states().get(mid) == S.MACHINE_STATE_CONFIGURED for mid in records),
                        20, "CONFIGURED NodeStateUpdates")
            for mid in records:
                seq = [ORDER[u.state] for u in op.node_updates(mid)]
                assert seq == sorted(seq), (mid, seq)
                last = op.node_updates(mid)[-1]
                assert last.cluster_id == "c1" and last.node_name and last.provider_id
                assert last.resources.resources.get("cpu")

            # A malformed roll-up is rejected whole; the table keeps the previous content.
            bad = need("1")
            bad.interruption_penalty_bucket = 99  # type: ignore[assignment]
            await op.send_rollup([need("1", count=50), bad])
            await until(lambda: op.acks("rollup-rejected:"), 20, "rejection reported on the stream")
            await shard.wait_cycles(2)
            frames = await shard.inspect("c1")
            assert frames[0].header.total_needs == 1
            assert frames[1].need.need.aggregate_resources["cpu"] in ("21", "21000m")
            assert (await shard.counts()).bound_by_cluster.get("c1", 0) == 3
            assert not op.reclaims()

            # Demand removed: reclaim instructions naming the nodes, then back to Idle after the ack.
            await op.send_rollup([])

            async def all_unbound() -> bool:
                c = await shard.counts()
                return c.bound_by_cluster.get("c1", 0) == 0 and not c.by_state.get("MACHINE_STATE_DRAINING", 0)
            await until(all_unbound, 60, "reclaimed machines back to Idle")
            node_names = {u.node_name for mid in records for u in op.node_updates(mid)}
            reclaimed = [n for ri in op.reclaims() for n in ri.nodes]
            assert sorted(reclaimed) == sorted(node_names)
            assert all(ri.grace_period_seconds > 0 and ri.preemptor_priority == 0 for ri in op.reclaims())
            assert spy.per_machine("Drain") == {mid: 1 for mid in records}
            # The final Draining → Idle update reaches the cluster the machine left.
            for mid in records:
                assert op.node_updates(mid)[-1].state == S.MACHINE_STATE_IDLE
            # Idle elastic machines are released after their hold (1 s here); committed ones stay.
            created = set(spy.per_machine("Create"))
            assert created  # 2 committed hosts could not cover 3 machines

            async def released() -> bool:
                ms = {m.id: m.state for m in await spy.list_machines()}
                return all(ms[mid] == S.MACHINE_STATE_SPECULATIVE for mid in created) and all(
                    ms[mid] == S.MACHINE_STATE_IDLE for mid in records if mid not in created)
            await until(released, 30, "created machines released, committed kept")
            assert spy.per_machine("Delete") == {mid: 1 for mid in created}


@pytest.mark.parametrize("engine", ["worker", "inline"])
async def test_higher_priority_cluster_preempts_lower(engine: str) -> None:
    shard_args = ("--engine-mode", engine)
    async with fleet(("--seed-count", "0", "--committed-count", "2"), shard_args) as (_prov, spy, shard):  # noqa: SIM117
        async with FakeOperator(shard.addr, "low") as low, FakeOperator(shard.addr, "high") as high:
            await low.send_rollup([need("7", count=2, priority=100)])
            await until(lambda: _bound(shard, "low", 2), 40, "low cluster holds both machines")
            await high.send_rollup([need("7", count=1, priority=1_000_000)])
            await until(lambda: _bound(shard, "high", 1), 60, "high cluster got a machine by preemption")
            assert (await shard.counts()).bound_by_cluster.get("low", 0) == 1
            preempts = low.reclaims()
            assert len(preempts) == 1 and preempts[0].preemptor_priority == 1_000_000
            assert preempts[0].grace_period_seconds == 10  # priority gap > 900 000
            assert not high.reclaims()
            assert len(spy.of("Drain")) == 1
            # verdicts reach InspectNeeds in both engine modes
            frames = await shard.inspect("high")
            assert frames[0].header.cycle > 0 and frames[1].need.claimed_machine_count == 1


async def _bound(shard: ShardProc, cluster: str, n: int) -> bool:
    return (await shard.counts()).bound_by_cluster.get(cluster, 0) == n


async def test_kill9_mid_cycle_restart_rebuilds_without_duplicates_or_reclaims() -> None:
    provider = ("--seed-count", "4", "--committed-count", "1", "--create-delay", "5", "--configure-delay", "0.5")
    async with fleet(provider) as (_p, spy, shard):
        async with FakeOperator(shard.addr, "c1") as op:
            await op.send_rollup([need("7", count=3)])
            await until(lambda: len(spy.of("Create")) >= 1, 30, "a Create in flight")
        assert shard.proc is not None
        shard.proc.kill()  # SIGKILL with Creates (and maybe a Configure) in flight, cycles every 0.3 s
        calls_at_kill = len(spy.calls)

        await shard.start()  # same data dir: epoch 2, rebuilt from the provider's List
        await until(lambda: _reconciled(shard), 30, "restarted shard reconciled")
        await shard.wait_cycles(5)
        after = [n for n, _ in spy.calls[calls_at_kill:]]
        # No operator yet: nothing is drained (Phase 3 waits for the first roll-up) and nothing created.
        assert "Drain" not in after and "Create" not in after and "Delete" not in after
        async with FakeOperator(shard.addr, "c1") as op2:
            await until(lambda: op2.acks("hello"), 10, "hello ack")
            await op2.send_rollup([need("7", count=3)])
            await until(lambda: _bound_configured(shard, "c1", 3), 40, "3 Configured after restart")
            await shard.wait_cycles(5)
            c = await shard.counts()
            assert c.shard_epoch == 2
            assert c.bound_by_cluster.get("c1", 0) == 3
            assert not op2.reclaims()
        assert "Drain" not in [n for n, _ in spy.calls]
        created = spy.per_machine("Create")
        assert max(created.values()) == 1, created  # no machine created twice
        assert len(created) == 2, created  # 1 committed + 2 created = 3: the restart over-acquired nothing
        # exactly three machines carry c1 at the provider: nothing double-assigned, nothing lost
        assert len([m for m in await spy.list_machines() if m.cluster == "c1"]) == 3
        # every mutation after the restart carries the new epoch
        assert all(r.shard_epoch == 2 for n, r in spy.calls[calls_at_kill:] if n in ("Create", "Configure"))


async def _reconciled(shard: ShardProc) -> bool:
    return bool((await shard.counts()).reconciled)


async def _bound_configured(shard: ShardProc, cluster: str, n: int) -> bool:
    c = await shard.counts(cluster)
    return c.by_state.get("MACHINE_STATE_CONFIGURED", 0) == n


async def test_provider_death_fails_inflight_machines_and_sessions_keep_working() -> None:
    async with fleet(("--seed-count", "3", "--create-delay", "60"), ("--execute-timeout", "2")) as (prov, spy, shard):  # noqa: SIM117
        async with FakeOperator(shard.addr, "c1") as op:
            await op.send_rollup([need("7", count=2)])
            await until(lambda: len(spy.of("Create")) >= 1, 30, "Create in flight")
            prov.kill()

            async def failed() -> bool:
                return (await shard.counts()).by_state.get("MACHINE_STATE_FAILED", 0) >= 1
            await until(failed, 30, "in-flight machines FAILED after the timeout")
            fails = [u for u in op.node_updates() if u.state == S.MACHINE_STATE_FAILED]
            await until(lambda: [u for u in op.node_updates() if u.state == S.MACHINE_STATE_FAILED], 10,
                        "FAILED NodeStateUpdate")
            fails = [u for u in op.node_updates() if u.state == S.MACHINE_STATE_FAILED]
            assert all(u.last_error for u in fails)
            # The shard keeps serving: a new roll-up is acknowledged, a new session is accepted.
            n_acks = len(op.acks("rollup"))
            await op.send_rollup([need("7", count=1)])
            await until(lambda: len(op.acks("rollup")) > n_acks, 10, "roll-up ack after provider death")
            async with FakeOperator(shard.addr, "c2") as op2:
                await until(lambda: op2.acks("hello"), 10, "new session accepted")


async def test_failed_transition_is_served_from_elsewhere_and_sigterm_is_explicit() -> None:
    async with fleet(("--seed-count", "6", "--fail-label", "bigfleet.fake/cloud=gcp")) as (_p, spy, shard):  # noqa: SIM117
        async with FakeOperator(shard.addr, "c1") as op:
            await op.send_rollup([need("7", count=1)])
            await until(lambda: _bound_configured(shard, "c1", 1), 60, "demand met despite failures")
            records = await spy.list_machines()
            bound = [m for m in records if m.cluster == "c1" and m.state == S.MACHINE_STATE_CONFIGURED]
            assert len(bound) == 1 and bound[0].labels["bigfleet.fake/cloud"] != "gcp"
            failed = [m for m in records if m.state == S.MACHINE_STATE_FAILED]
            assert failed and all(m.last_error for m in failed)
            c = await shard.counts()
            assert c.by_state.get("MACHINE_STATE_FAILED", 0) == len(failed)
            # SIGTERM: the stream ends with an explicit status telling the operator to reconnect.
            assert shard.proc is not None
            assert shard.proc.stop(timeout=20) == 0
            await until(lambda: op.status is not None, 10, "stream closed")
            assert op.status == grpc.StatusCode.UNAVAILABLE and op.details == "shard shutting down; reconnect"




async def test_reconnect_replaces_session_and_replays_node_state() -> None:
    async with fleet(("--seed-count", "0", "--committed-count", "2")) as (_p, spy, shard):  # noqa: SIM117
        async with FakeOperator(shard.addr, "c1") as op1:
            await op1.send_rollup([need("7", count=2)])
            await until(lambda: _bound_configured(shard, "c1", 2), 30, "2 Configured")
            bound = {m.id for m in await spy.list_machines() if m.cluster == "c1"}
            async with FakeOperator(shard.addr, "c1") as op2:
                # the newer session wins; the older one is closed with an explicit status
                await until(lambda: op1.status is not None, 10, "old session closed")
                assert op1.status == grpc.StatusCode.ABORTED
                # the new session gets the node state of every bound machine without asking
                await until(lambda: set(op2.latest_node_states()) == bound, 10, "node state replay")
                assert set(op2.latest_node_states().values()) == {S.MACHINE_STATE_CONFIGURED}
                assert op2.frames[0].WhichOneof("payload") == "ack"
                # and keeps working: its roll-up is acknowledged, nothing is reclaimed
                await op2.send_rollup([need("7", count=2)])
                await until(lambda: op2.acks("rollup"), 10, "roll-up ack on the new session")
                await shard.wait_cycles(3)
                assert not op2.reclaims() and not spy.of("Drain")


async def test_a_restart_continues_the_shard_cycle_on_every_surface() -> None:
    """The shard cycle is the replicated engine state's: after a restart ShardAdmin (and ShardRead)
    continue it, as the Session's NeedVerdicts do (ShardRead counted from 1 again at every start)."""
    async with fleet(("--seed-count", "2",)) as (_p, _spy, shard):
        async with FakeOperator(shard.addr, "c1") as op:
            await op.send_rollup([need("1")])
            await shard.wait_cycles(15)
            before = await shard.cycle()
        assert shard.proc is not None and shard.proc.stop(timeout=20) == 0
        await shard.start()
        await until(lambda: _reconciled(shard), 30, "restarted shard reconciled")
        await shard.wait_cycles(2)
        # (the carried state is written at most once a second, so a restart may repeat a few of the
        # last numbers: 0.3 s cycles; the per-start counter it replaced would read 2 or 3 here)
        assert await shard.cycle() >= before - 5
        async with FakeOperator(shard.addr, "c1") as op:
            await until(lambda: op.of("need_verdicts"), 10, "verdicts on the new session")
            assert abs(op.of("need_verdicts")[-1].need_verdicts.cycle - await shard.cycle()) <= 2
