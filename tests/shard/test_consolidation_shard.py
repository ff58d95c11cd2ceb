"""The shard's side of consolidation: a cluster's roll-up overrides the shard's switch (validated,
replicated with the roll-up), the engine gets the budget room for consolidate drains, and the
decision's consolidation counts reach the metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from bigfleet.decision import Decision, EngineState, PhaseStats
from bigfleet.observability import new_registry
from bigfleet.shard.daemon import DaemonConfig, ShardDaemon
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.testing import free_port
from bigfleet.v1alpha1 import capacity_pb2

from .opsim import need


@pytest.fixture
async def daemon() -> AsyncIterator[ShardDaemon]:
    cfg = DaemonConfig(shard_id="s1", provider=f"127.0.0.1:{free_port()}", epoch=3, engine_mode="inline",
                       disruption_budgets=("1/1h;reasons=consolidate",))
    d = ShardDaemon(cfg, ShardMetrics(new_registry()))
    try:
        yield d
    finally:
        await d.stop(drain_timeout=0.2)


def rollup(cluster: str, consolidation: str) -> capacity_pb2.ClusterCapacityNeeds:
    return capacity_pb2.ClusterCapacityNeeds(cluster_id=cluster, needs=[need("1")], consolidation=consolidation)


async def test_rollup_overrides_the_shard_switch(daemon: ShardDaemon) -> None:
    d = daemon
    assert d.engine_config().consolidation is False and d.engine_config().consolidation_room == ()
    assert (await d.handle_rollup("c1", rollup("c1", "on"))).accepted
    assert (await d.handle_rollup("c2", rollup("c2", ""))).accepted
    cfg = d.engine_config()
    assert cfg.consolidation_overrides == (("c1", True),)
    assert cfg.consolidation_room == (("c1", 1),)  # its budget: one consolidate drain an hour
    # the switch alone is a change (not the digest of an identical roll-up), and "off" wins over the shard
    d.config.engine = replace(d.config.engine, consolidation=True)
    assert (await d.handle_rollup("c1", rollup("c1", "off"))).accepted
    cfg = d.engine_config()
    assert cfg.consolidation_overrides == (("c1", False),) and cfg.consolidation_room == (("c2", 1),)
    bad = await d.handle_rollup("c1", rollup("c1", "maybe"))
    assert not bad.accepted and "consolidation" in bad.error
    d.forget_cluster("c1")
    assert d.engine_config().consolidation_overrides == ()


async def test_consolidation_counts_reach_the_metrics(daemon: ShardDaemon) -> None:
    st = PhaseStats(consolidation_replacements=2, consolidation_drains=1, consolidation_savings_per_hour=1.5)
    await daemon.dispatcher.dispatch(Decision((), (), (), st, EngineState()))
    m = daemon.metrics
    assert m.consolidation_replacements.labels("acquired")._value.get() == 2
    assert m.consolidation_replacements.labels("retired")._value.get() == 1
    assert m.consolidation_savings._value.get() == 1.5
