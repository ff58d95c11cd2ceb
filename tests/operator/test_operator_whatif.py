"""Dry-run CapacityRequests (annotation bigfleet.lucy.sh/dry-run: "true") against the k8stest API server
and a fake shard that also serves ShardRead.WhatIf: never rolled up, answered into status.whatIf (an
invalid one says why), and rolled up as usual once the annotation goes (the old answer is removed)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from conftest import cr
from fakeshard import FakeShard, eventually

from bigfleet.k8stest import KubeTestServer
from bigfleet.operator.app import Operator, OperatorConfig
from bigfleet.operator.crds import DRY_RUN_ANNOTATION, is_dry_run
from bigfleet.operator.rollup import build_rollup
from bigfleet.operator.session import Backoff
from bigfleet.rpc import new_server
from bigfleet.security.tls import add_port
from bigfleet.v1alpha1 import shard_pb2_grpc, shardread_pb2, shardread_pb2_grpc


class WhatIfShard(FakeShard, shardread_pb2_grpc.ShardReadServicer):
    """FakeShard plus a WhatIf that answers "idle" for small needs and "unsatisfiable" for big ones."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[shardread_pb2.WhatIfRequest] = []

    async def start(self, tls: Any = None) -> WhatIfShard:
        self.server, _ = new_server()
        shard_pb2_grpc.add_ShardServicer_to_server(self, self.server)
        shardread_pb2_grpc.add_ShardReadServicer_to_server(self, self.server)
        add_port(self.server, self.target, tls)
        await self.server.start()
        return self

    async def WhatIf(self, request: shardread_pb2.WhatIfRequest, context: grpc.aio.ServicerContext
                     ) -> shardread_pb2.WhatIfResponse:
        self.asked.append(request)
        out = shardread_pb2.WhatIfResponse(cycle=42)
        for i, n in enumerate(request.needs):
            big = n.aggregate_resources.get("cpu", "0") == "100"
            a = out.answers.add(index=i, profile_fingerprint=f"fp{i}", message="m")
            if big:
                a.outcome = shardread_pb2.WHAT_IF_OUTCOME_UNSATISFIABLE
                a.unmet_reason = shardread_pb2.UNMET_REASON_NO_MATCHING_SUPPLY
                a.residual_deficit.resources["cpu"] = "100"
            else:
                a.outcome = shardread_pb2.WHAT_IF_OUTCOME_PREEMPTION
                a.victims = 1
                a.victim_priorities.add(priority=10, machines=1)
        return out


@pytest.fixture
async def wshard() -> AsyncIterator[WhatIfShard]:
    s = await WhatIfShard().start()
    yield s
    await s.stop()


def dry(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"]["annotations"] = {DRY_RUN_ANNOTATION: "true"}
    return obj


def test_dry_run_crs_are_left_out_of_the_rollup() -> None:
    crs = [cr("a", {"cpu": "1"}), dry(cr("b", {"cpu": "1"})), dry(cr("c", {"cpu": "2"}, priority=7))]
    assert [is_dry_run(c) for c in crs] == [False, True, True]
    r = build_rollup("c1", crs, 0)
    assert r.crs_included == 1 and set(r.fingerprints) == {("default", "a")} and r.to_acknowledge == (("default", "a"),)
    crs[1]["metadata"]["annotations"][DRY_RUN_ANNOTATION] = "false"
    assert build_rollup("c1", crs, 0).crs_included == 2


async def test_dry_run_answers_land_in_status(kube: KubeTestServer, api: Any, wshard: WhatIfShard) -> None:
    s = kube.store
    s.put(cr("real", {"cpu": "1"}))
    s.put(dry(cr("try", {"cpu": "2"}, priority=500)))
    s.put(dry(cr("huge", {"cpu": "100"})))
    s.put(dry(cr("bad", {"cpu": "1"}, requirements=[{"key": "k", "operator": "Gt", "values": ["1"]}])))
    cfg = OperatorConfig(cluster_id="c1", shard_addr=wshard.target, rollup_interval=30.0, debounce=0.05,
                         namespace="bigfleet-system")
    op = Operator(cfg, api, backoff=Backoff(initial=0.05, cap=0.2))
    task = asyncio.create_task(op.run())
    try:
        def status(name: str) -> dict[str, Any]:
            return dict(((s.find("capacityrequests", name, "default") or {}).get("status") or {}).get("whatIf") or {})

        await eventually(lambda: status("try") and status("huge") and status("bad"), what="what-if answers")
        t = status("try")
        assert t["outcome"] == "Preemption" and t["satisfiable"] is True and t["victims"] == 1
        assert t["victimPriorities"] == [{"priority": 10, "machines": 1}] and t["shardCycle"] == 42
        h = status("huge")
        assert h["outcome"] == "Unsatisfiable" and h["unmetReason"] == "NoMatchingSupply" and h["deficit"] == {"cpu": "100"}
        b = status("bad")
        assert b["outcome"] == "Invalid" and "Gt" in b["message"]
        # one call for both valid CRs, each as its own need; none of them was rolled up
        assert len(wshard.asked[0].needs) == 2 and wshard.asked[0].cluster_id == "c1"
        await eventually(lambda: wshard.rollups, what="a roll-up")
        assert all(len(r.needs) == 1 for r in wshard.rollups)
        # The annotation goes: rolled up, and the stale answer is removed.
        rtype = next(r for r in s.resources if r.plural == "capacityrequests")
        s.patch(rtype, "default", "try", {"metadata": {"annotations": {DRY_RUN_ANNOTATION: None}}},
                "application/merge-patch+json")
        await eventually(lambda: not status("try"), what="the what-if answer removed")
        await eventually(lambda: any(len(r.needs) == 2 for r in wshard.rollups), what="the CR rolled up")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
