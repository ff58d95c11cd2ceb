"""The series a cycle publishes for dashboards and alerts (docs/operator-guide.md#metrics): the
inventory by state, capacity type and interruption penalty bucket; demand in machines by penalty
bucket; shortfalls by age; reclaims held back by the cap; and what a replica that stops leading
leaves behind (nothing of the last cycle's figures)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bigfleet.decision import Decision, EngineConfig, EngineState, PhaseStats
from bigfleet.needs.penalty import PenaltyBucket
from bigfleet.observability import new_registry
from bigfleet.shard.daemon import DaemonConfig, ShardDaemon
from bigfleet.shard.metrics import ShardMetrics, shortfall_age_bucket
from bigfleet.testing import free_port
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2
from bigfleet.wire.machine import META_ASSIGNED_PRIORITY, META_INTERRUPTION_PENALTY, META_NEED_FINGERPRINT

from .opsim import need

S = provider_pb2.MachineState
CT = provider_pb2.CapacityType
B1024 = PenaltyBucket.B1024


def samples(registry: CollectorRegistry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    text = generate_latest(registry).decode()
    return {tuple(sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name}


def machine(mid: str, state: int, capacity_type: int, cluster: str = "", fp: str = "",
            penalty: str = "") -> provider_pb2.Machine:
    pb = provider_pb2.Machine(id=mid, state=state, instance_type="m5.2xlarge", zone="us-east-1a",  # type: ignore[arg-type]
                              capacity_type=capacity_type, price_per_hour=0.1,  # type: ignore[arg-type]
                              interruption_probability=0.05 if capacity_type == CT.CAPACITY_TYPE_SPOT else 0.0,
                              cluster=cluster, labels={"topology.kubernetes.io/zone": "us-east-1a"})
    pb.resources.resources.update({"cpu": "8", "memory": "32Gi"})
    if state != S.MACHINE_STATE_SPECULATIVE:
        pb.host.provider, pb.host.ref = "fake", f"host-{mid}"
    if fp:
        pb.shard_metadata.update({META_NEED_FINGERPRINT: fp, META_ASSIGNED_PRIORITY: "100",
                                  META_INTERRUPTION_PENALTY: penalty})
    return pb


def key(state: str, capacity_type: str, penalty: str) -> tuple[tuple[str, str], ...]:
    """An inventory series' labels, as `samples` keys them."""
    return (("capacity_type", capacity_type), ("interruption_penalty_bucket", penalty), ("state", state))


def zoned(zone: str, cpu: str, bucket: int) -> capacity_pb2.CapacityNeed:
    n = need(cpu, interruption_bucket=bucket)
    n.requirements.add(key="topology.kubernetes.io/zone", operator=capacity_pb2.NodeSelectorRequirement.OPERATOR_IN,
                       values=[zone])
    return n


@pytest.fixture(params=["inline", "worker"])
async def daemon(request: pytest.FixtureRequest) -> AsyncIterator[ShardDaemon]:
    # Paused: the cycle decides (verdicts, stats) but executes nothing against the absent provider.
    cfg = DaemonConfig(shard_id="s1", provider=f"127.0.0.1:{free_port()}", epoch=3, engine_mode=request.param,
                       engine=replace(EngineConfig(), paused=True))
    d = ShardDaemon(cfg, ShardMetrics(new_registry()))
    d.engine.start()
    try:
        yield d
    finally:
        await d.stop(drain_timeout=0.2)


async def test_cycle_publishes_inventory_demand_and_aged_shortfalls(daemon: ShardDaemon) -> None:
    d = daemon
    reg = d.metrics.registry
    # c1: one need in the $1024 interruption bucket that fits us-east-1a; one (unspecified bucket)
    # for a zone no machine is in: short.
    served, short = zoned("us-east-1a", "4", B1024), zoned("nowhere", "4", 0)
    assert (await d.handle_rollup("c1", capacity_pb2.ClusterCapacityNeeds(cluster_id="c1", needs=[served, short]))).accepted
    fps = {n.profile.interruption_bucket: n.fingerprint for n in d.store.table.cluster("c1")}
    # c1's served need already holds a Configured spot machine (stamped $1024 when configured);
    # two idle machines (on-demand, reserved) and a speculative one hold nothing.
    d.view.set(machine("m-conf", S.MACHINE_STATE_CONFIGURED, CT.CAPACITY_TYPE_SPOT, "c1", fps[B1024], "1024"))
    d.view.set(machine("m-idle1", S.MACHINE_STATE_IDLE, CT.CAPACITY_TYPE_ON_DEMAND))
    d.view.set(machine("m-idle2", S.MACHINE_STATE_IDLE, CT.CAPACITY_TYPE_RESERVED))
    d.view.set(machine("m-spec", S.MACHINE_STATE_SPECULATIVE, CT.CAPACITY_TYPE_ON_DEMAND))
    d.reconciled.set()
    assert await d.run_cycle() is not None

    inv = samples(reg, "bigfleet_shard_inventory_machines")
    assert inv == {key("configured", "spot", "1024"): 1, key("idle", "on_demand", "none"): 1,
                   key("idle", "reserved", "none"): 1, key("speculative", "on_demand", "none"): 1}
    # The Configured machine serves the $1024 need (4 CPUs on 8); nothing can serve the other.
    assert samples(reg, "bigfleet_shard_demand_machines") == {
        (("interruption_penalty_bucket", "1024"),): 1, (("interruption_penalty_bucket", "unspecified"),): 0}
    aged = samples(reg, "bigfleet_shard_shortfalls_aged")
    assert aged == {(("bucket", "1-9"),): 1, (("bucket", "10-59"),): 0, (("bucket", "60-299"),): 0,
                    (("bucket", "300+"),): 0}
    assert samples(reg, "bigfleet_shard_shortfalls") == {(): 1}

    # A machine leaving a label set leaves that series at 0 (not a stale count).
    d.view.forget("m-idle2")
    failed = machine("m-idle1", S.MACHINE_STATE_FAILED, CT.CAPACITY_TYPE_ON_DEMAND)
    failed.last_error = "disk gone"
    assert d.view.set(failed)
    assert await d.run_cycle() is not None
    inv = samples(reg, "bigfleet_shard_inventory_machines")
    assert inv[key("idle", "reserved", "none")] == 0 and inv[key("idle", "on_demand", "none")] == 0
    assert inv[key("failed", "on_demand", "none")] == 1
    assert sum(inv.values()) == 3

    # Stepping down (or shutting down) drops the last cycle's figures: a follower exports none.
    await d.stop(drain_timeout=0.2)
    assert samples(reg, "bigfleet_shard_inventory_machines") == {}
    assert samples(reg, "bigfleet_shard_demand_machines") == {}
    assert set(samples(reg, "bigfleet_shard_shortfalls_aged").values()) == {0}
    assert samples(reg, "bigfleet_shard_shortfalls") == {(): 0}


def test_shortfall_age_buckets() -> None:
    assert [shortfall_age_bucket(a) for a in (1, 9, 10, 59, 60, 299, 300, 10_000)] == \
        ["1-9", "1-9", "10-59", "10-59", "60-299", "60-299", "300+", "300+"]


async def test_aged_shortfalls_count_every_short_profile_and_capped_reclaims_accumulate() -> None:
    cfg = DaemonConfig(shard_id="s1", provider=f"127.0.0.1:{free_port()}", epoch=3, engine_mode="inline")
    d = ShardDaemon(cfg, ShardMetrics(new_registry()))
    try:
        reg = d.metrics.registry
        # the carried ages hold every short profile, also those past the report cap (none reported here)
        ages = {"a": 1, "b": 12, "c": 299, "d": 300, "e": 4000}
        d._publish_shortfalls(Decision((), (), (), PhaseStats(), EngineState(shortfall_ages=ages)))
        assert samples(reg, "bigfleet_shard_shortfalls_aged") == {
            (("bucket", "1-9"),): 1, (("bucket", "10-59"),): 1, (("bucket", "60-299"),): 1, (("bucket", "300+"),): 2}
        assert samples(reg, "bigfleet_shard_shortfalls") == {(): 0}
        for n in (3, 0, 2):
            d.dispatcher.count(Decision((), (), (), PhaseStats(reclaims_deferred=n), EngineState()), None)
        assert samples(reg, "bigfleet_shard_reclaims_capped_total") == {(): 5}
    finally:
        await d.stop(drain_timeout=0.2)


def test_a_replica_that_never_led_exports_no_cycle_figures() -> None:
    reg = new_registry()
    ShardMetrics(reg)
    assert samples(reg, "bigfleet_shard_inventory_machines") == {}
    assert samples(reg, "bigfleet_shard_demand_machines") == {}
    assert set(samples(reg, "bigfleet_shard_shortfalls_aged").values()) == {0}
    assert len(samples(reg, "bigfleet_shard_shortfalls_aged")) == 4
    assert samples(reg, "bigfleet_shard_reclaims_capped_total") == {(): 0}
