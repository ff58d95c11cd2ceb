"""ShardRead.WhatIf in-process: answers from a copy of the shard's state, validates its input with
INVALID_ARGUMENT, and neither actuates (no provider call, no dispatch) nor replicates (no log write)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import NoReturn

import grpc
import pytest

from bigfleet.observability import new_registry
from bigfleet.shard.daemon import DaemonConfig, ShardDaemon
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.readsvc import ShardReadServicer
from bigfleet.testing import free_port
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2, shardread_pb2
from bigfleet.wire.machine import META_ASSIGNED_PRIORITY

from .opsim import need
from .test_daemon_unit import machine

S = provider_pb2.MachineState
W = shardread_pb2.WhatIfOutcome


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class Ctx:
    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: object = ()) -> NoReturn:
        raise Aborted(code, details)


def _boom(*_a: object, **_k: object) -> NoReturn:
    raise AssertionError("what-if must not actuate or replicate")


@pytest.fixture
async def daemon() -> AsyncIterator[ShardDaemon]:
    d = ShardDaemon(DaemonConfig(shard_id="s1", provider=f"127.0.0.1:{free_port()}", epoch=3, engine_mode="inline"),
                    ShardMetrics(new_registry()))
    bound = machine("b1", S.MACHINE_STATE_CONFIGURED, cluster="c2")
    bound.shard_metadata[META_ASSIGNED_PRIORITY] = "10"
    for pb in (machine("i1", S.MACHINE_STATE_IDLE), machine("s1", S.MACHINE_STATE_SPECULATIVE), bound):
        d.view.set(pb)
    assert (await d.handle_rollup("c2", capacity_pb2.ClusterCapacityNeeds(
        cluster_id="c2", needs=[need("8", priority=10)]))).accepted
    d.reconciled.set()
    try:
        yield d
    finally:
        await d.stop(drain_timeout=0.2)


def _ask(cluster: str, *needs: capacity_pb2.CapacityNeed) -> shardread_pb2.WhatIfRequest:
    return shardread_pb2.WhatIfRequest(cluster_id=cluster, needs=list(needs))


async def test_answers_by_source_without_acting(daemon: ShardDaemon) -> None:
    d = daemon
    for name in ("replace", "save_engine", "hold_rollup", "record_disruptions", "set_actuation", "claim"):
        setattr(d.log, name, _boom)
    for name in ("create", "configure", "drain", "delete"):
        setattr(d.provider, name, _boom)
    d.dispatcher.dispatch = _boom  # type: ignore[method-assign]
    before = ({m.id: m for m in d.view.machines()}, d.store.table.snapshot(), d.store.engine_state().to_dict())
    svc = ShardReadServicer(d)
    r = await svc.WhatIf(_ask("c1", need("8"), need("8", priority=5, count=2), need("8", priority=1000), need("64")), Ctx())
    idle, spec, pre, no = r.answers
    assert (idle.outcome, idle.idle_count) == (W.WHAT_IF_OUTCOME_IDLE, 1)
    assert (spec.outcome, spec.idle_count, spec.speculative_count) == (W.WHAT_IF_OUTCOME_SPECULATIVE, 1, 1)
    assert idle.index == 0 and no.index == 3 and idle.profile_fingerprint
    # 3 machines at priority 1000: idle + speculative + c2's bound one (preempted)
    r2 = await svc.WhatIf(_ask("c1", need("8", priority=1000, count=3)), Ctx())
    p = r2.answers[0]
    assert p.outcome == W.WHAT_IF_OUTCOME_PREEMPTION and p.victims == 1
    assert [(v.priority, v.machines) for v in p.victim_priorities] == [(10, 1)]
    assert [x.cluster_id for x in p.displaced] == ["c2"]
    assert pre.outcome == W.WHAT_IF_OUTCOME_IDLE  # each alone: the idle machine is free for it
    assert no.outcome == W.WHAT_IF_OUTCOME_UNSATISFIABLE and no.unmet_reason != 0
    assert no.residual_deficit.resources["cpu"] and "not satisfiable" in no.message
    assert not r.all_satisfiable
    after = ({m.id: m for m in d.view.machines()}, d.store.table.snapshot(), d.store.engine_state().to_dict())
    assert after == before and not d.view.inflight and d.cycles == 0
    assert d.metrics.whatif_calls.labels("ok")._value.get() == 2


@pytest.mark.parametrize(("req", "field"), [
    (_ask("", need("1")), "cluster_id"),
    (_ask("c 1", need("1")), "cluster_id"),
    (_ask("c1"), "needs"),
    (_ask("c1", *[need("1")] * 33), "needs"),
    (_ask("c1", capacity_pb2.CapacityNeed(aggregate_resources={"cpu": "-1"})), "needs[0].aggregate_resources"),
    (_ask("c1", capacity_pb2.CapacityNeed(aggregate_resources={"cpu": "lots"})), "needs[0].aggregate_resources"),
    (_ask("c1", capacity_pb2.CapacityNeed()), "needs[0].aggregate_resources"),
    (_ask("c1", capacity_pb2.CapacityNeed(aggregate_resources={"cpu": "1"}, group="g" * 300)), "group"),
    (_ask("c1", capacity_pb2.CapacityNeed(aggregate_resources={"cpu": "1"}, interruption_penalty_bucket=99)),  # type: ignore[arg-type]
     "interruption_penalty_bucket"),
], ids=["no-cluster", "space", "no-needs", "too-many", "negative", "unparsable", "empty", "long-group", "bucket"])
async def test_bad_input_is_invalid_argument(daemon: ShardDaemon, req: shardread_pb2.WhatIfRequest, field: str) -> None:
    with pytest.raises(Aborted) as exc:
        await ShardReadServicer(daemon).WhatIf(req, Ctx())
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in str(exc.value)


async def test_unavailable_before_the_inventory_is_read(daemon: ShardDaemon) -> None:
    daemon.reconciled.clear()
    with pytest.raises(Aborted) as exc:
        await ShardReadServicer(daemon).WhatIf(_ask("c1", need("1")), Ctx())
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE


async def test_plan_consolidation_on_a_copy() -> None:
    from bigfleet.operator.rollup import need_fingerprint
    from bigfleet.wire.machine import META_NEED_FINGERPRINT

    d = ShardDaemon(DaemonConfig(shard_id="s1", provider=f"127.0.0.1:{free_port()}", epoch=3, engine_mode="inline"),
                    ShardMetrics(new_registry()))
    try:
        want = need("4")
        dear = machine("dear", S.MACHINE_STATE_CONFIGURED, cluster="c1", price=1.0)
        dear.shard_metadata[META_NEED_FINGERPRINT] = need_fingerprint(want)
        for pb in (dear, machine("cheap", S.MACHINE_STATE_IDLE, price=0.1)):
            d.view.set(pb)
        d.reconciled.set()
        assert (await d.handle_rollup("c1", capacity_pb2.ClusterCapacityNeeds(cluster_id="c1", needs=[want]))).accepted
        for name in ("create", "configure", "drain", "delete"):
            setattr(d.provider, name, _boom)
        svc = ShardReadServicer(d)
        r = await svc.PlanConsolidation(shardread_pb2.PlanConsolidationRequest(), Ctx())
        (mv,) = r.moves
        assert (mv.cluster_id, mv.kind, mv.enabled) == ("c1", "cheaper", False) and list(r.enabled_clusters) == []
        assert mv.replacement.machine_id == "cheap" and mv.replacement.state == "idle"
        assert [p.machine_id for p in mv.replaced] == ["dear"] and mv.replaced[0].price_per_hour == 1.0
        assert abs(r.savings_per_hour - 0.9) < 1e-9 and abs(mv.savings_per_hour - 0.9) < 1e-9
        # on for the cluster (its roll-up says so): the same move, enabled
        on = capacity_pb2.ClusterCapacityNeeds(cluster_id="c1", needs=[want], consolidation="on")
        assert (await d.handle_rollup("c1", on)).accepted
        r = await svc.PlanConsolidation(shardread_pb2.PlanConsolidationRequest(cluster_id="c1"), Ctx())
        assert [m.enabled for m in r.moves] == [True] and list(r.enabled_clusters) == ["c1"]
        assert not (await svc.PlanConsolidation(shardread_pb2.PlanConsolidationRequest(cluster_id="c2"), Ctx())).moves
        with pytest.raises(Aborted) as exc:
            await svc.PlanConsolidation(shardread_pb2.PlanConsolidationRequest(cluster_id="a b"), Ctx())
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert not d.view.inflight and d.cycles == 0
    finally:
        await d.stop(drain_timeout=0.2)


async def test_every_read_refuses_a_malformed_cluster_filter(daemon: ShardDaemon) -> None:
    """InspectNeeds and GetInventoryCounts check an optional cluster id as WhatIf does (they answered
    an empty result for "bad id"); "" still means every cluster."""
    svc = ShardReadServicer(daemon)
    for call in (lambda c: _drain(svc.InspectNeeds(shardread_pb2.InspectNeedsRequest(cluster_id=c), Ctx())),
                 lambda c: svc.GetInventoryCounts(shardread_pb2.InventoryCountsRequest(cluster_id=c), Ctx())):
        with pytest.raises(Aborted) as exc:
            await call("bad id")
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(await _drain(svc.InspectNeeds(shardread_pb2.InspectNeedsRequest(), Ctx()))) == 1  # (the header)
    assert (await svc.GetInventoryCounts(shardread_pb2.InventoryCountsRequest(), Ctx())).total == 3


async def _drain(it: AsyncIterator[shardread_pb2.InspectNeedsResponse]) -> list[shardread_pb2.InspectNeedsResponse]:
    return [r async for r in it]
