"""Disruption budgets at the shard's dispatch boundary, in-process: the default reclaim rate holds
per cycle interval however often cycles run, a cluster's own budget (from its roll-up) wins over
the shard's default, the fleet-wide budget limits idle releases, and the recorded history survives
a failover to a new leader (the replicated state)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bigfleet.budget import Disruption
from bigfleet.decision import Decision, Delete, Drain, EngineState, PhaseStats
from bigfleet.observability import new_registry
from bigfleet.shard.daemon import DaemonConfig, ShardDaemon
from bigfleet.shard.ha.node import LocalLog
from bigfleet.shard.ha.state import HAState
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.testing import free_port
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2

from .opsim import need
from .test_daemon_unit import machine

S = provider_pb2.MachineState
NS = 1_000_000_000
T0 = 1_800_000_000 * NS  # a Friday night in 2027 (no blackout in these rules)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> int:
        return self.now


def make(log: LocalLog, clock: Clock, epoch: int, **cfg: object) -> tuple[ShardDaemon, list[str]]:
    config = DaemonConfig(shard_id="s1", provider=f"127.0.0.1:{free_port()}", epoch=epoch, cycle_interval=10.0,
                          compute_inline=True, wall_ns=clock, **cfg)  # type: ignore[arg-type]
    d = ShardDaemon(config, ShardMetrics(new_registry()), log=log)
    drained: list[str] = []
    d.executor.submit_drain = lambda mid, *a, **k: drained.append(mid) or True  # type: ignore[method-assign,func-returns-value]
    d.executor.submit_delete = lambda mid: drained.append(mid) or True  # type: ignore[method-assign,func-returns-value]
    return d, drained


def configured(d: ShardDaemon, cluster: str, n: int) -> None:
    for i in range(n):
        d.view.set(machine(f"{cluster}-m{i:02d}", S.MACHINE_STATE_CONFIGURED, cluster))
    d.store.mark_first_rollup(cluster)


def reclaims(cluster: str, n: int) -> Decision:
    acts = tuple(Drain(f"{cluster}-m{i:02d}", cluster, 600, 0, "reclaim") for i in range(n))
    return Decision(actions=acts, shortfalls=(), verdicts=(), stats=PhaseStats(), state=EngineState())


@pytest.fixture
def clock() -> Iterator[Clock]:
    yield Clock()


async def test_default_budget_is_a_rate_per_cycle_interval_not_per_cycle(clock: Clock) -> None:
    log = LocalLog(HAState(epoch=1))
    d, drained = make(log, clock, 1)
    configured(d, "c1", 40)  # 5 % of 40 = 2 per 10 s
    for second in range(0, 31):  # a cycle every second, each wanting 10 reclaims
        clock.now = T0 + second * NS
        await d.dispatcher.dispatch(reclaims("c1", 10))
    # windows (t-10 s, t]: 2 at t=0, 2 more once those age out at t=10 and t=20, 2 at t=30
    assert len(drained) == 8, drained
    assert d.metrics.disruptions_held.labels("reclaim", "cluster")._value.get() > 0
    assert d.metrics.action_outcomes.labels("Drain", "budget_held")._value.get() == 31 * 10 - 8
    # a small cluster still loses at most one machine per interval
    configured(d, "tiny", 3)
    clock.now = T0 + 100 * NS
    drained.clear()
    for second in range(5):
        clock.now = T0 + (100 + second) * NS
        await d.dispatcher.dispatch(reclaims("tiny", 3))
    assert len(drained) == 1


async def test_a_clusters_own_budget_from_its_rollup_wins(clock: Clock) -> None:
    log = LocalLog(HAState(epoch=1))
    d, drained = make(log, clock, 1)
    configured(d, "c1", 40)
    pb = capacity_pb2.ClusterCapacityNeeds(cluster_id="c1", needs=[need("1")], disruption_budgets=["1/1h"])
    assert (await d.handle_rollup("c1", pb)).accepted
    for minute in range(0, 30, 5):
        clock.now = T0 + minute * 60 * NS
        await d.dispatcher.dispatch(reclaims("c1", 10))
    assert len(drained) == 1
    bad = capacity_pb2.ClusterCapacityNeeds(cluster_id="c1", needs=[need("1")], disruption_budgets=["lots/1h"])
    out = await d.handle_rollup("c1", bad)
    assert not out.accepted and "disruption_budgets" in out.error


async def test_preemption_is_outside_the_default_budget_but_a_rule_can_name_it(clock: Clock) -> None:
    log = LocalLog(HAState(epoch=1))
    d, drained = make(log, clock, 1)
    configured(d, "low", 10)
    pre = Decision(actions=tuple(Drain(f"low-m{i:02d}", "low", 10, 1_000_000, "preempt") for i in range(5)),
                   shortfalls=(), verdicts=(), stats=PhaseStats(), state=EngineState())
    await d.dispatcher.dispatch(pre)
    assert len(drained) == 5  # priority is the throttle: the default budget limits reclaims only
    assert not log.state.disruptions  # nothing covered them: nothing recorded
    d2, drained2 = make(LocalLog(HAState(epoch=1)), clock, 1, disruption_budgets=("2/1h;reasons=preempt",))
    configured(d2, "low", 10)
    await d2.dispatcher.dispatch(pre)
    assert len(drained2) == 2


async def test_fleet_budget_limits_idle_releases(clock: Clock) -> None:
    log = LocalLog(HAState(epoch=1))
    d, drained = make(log, clock, 1, fleet_disruption_budgets=("3/10m;reasons=release",))
    for i in range(8):
        d.view.set(machine(f"idle{i}", S.MACHINE_STATE_IDLE))
    dec = Decision(actions=tuple(Delete(f"idle{i}") for i in range(8)), shortfalls=(), verdicts=(),
                   stats=PhaseStats(), state=EngineState())
    await d.dispatcher.dispatch(dec)
    assert len(drained) == 3
    assert d.metrics.disruptions_held.labels("release", "fleet")._value.get() == 5


async def test_history_survives_a_new_leader_and_stale_epochs_cannot_record(clock: Clock) -> None:
    state = HAState()
    log = LocalLog(state)
    epoch = (await log.claim("a"))[0]
    d, drained = make(log, clock, epoch)
    configured(d, "c1", 40)
    await d.dispatcher.dispatch(reclaims("c1", 10))
    assert len(drained) == 2 and len(state.disruptions["c1"]) == 2
    log.term += 1  # a new leader (a new Raft term) takes over the same replicated state
    epoch2 = (await log.claim("b"))[0]
    d2, drained2 = make(log, clock, epoch2)
    configured(d2, "c1", 40)
    clock.now += 5 * NS
    await d2.dispatcher.dispatch(reclaims("c1", 10))
    assert drained2 == []  # the window started under the old leader still holds
    assert not state.record_disruptions((("c1", Disruption("x", "reclaim", clock.now)),), 0, epoch)
    clock.now += 6 * NS
    await d2.dispatcher.dispatch(reclaims("c1", 10))
    assert len(drained2) == 2


def test_record_is_idempotent_and_prunes_old_entries() -> None:
    s = HAState()
    e = s.claim(1, "a", "A")
    d1 = Disruption("m1", "reclaim", 10 * NS)
    assert s.record_disruptions((("c", d1),), 0, e)
    assert s.record_disruptions((("c", d1),), 0, e)  # a retried command
    assert s.disruptions["c"] == (d1,)
    d2 = Disruption("m2", "reclaim", 100 * NS)
    assert s.record_disruptions((("c", d2),), 50 * NS, e)
    assert s.disruptions["c"] == (d2,)
