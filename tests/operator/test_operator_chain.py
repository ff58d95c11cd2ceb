"""Pod → CapacityRequest (pod controller) → roll-up (operator) → shard, all real code on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fakeshard import FakeShard, eventually

from bigfleet.k8stest import KubeTestServer
from bigfleet.operator.app import Operator, OperatorConfig
from bigfleet.operator.session import Backoff
from bigfleet.podcontroller.controller import PodController
from bigfleet.v1alpha1 import capacity_pb2


def pending_pod(name: str, cpu: str, gpu: str = "") -> dict[str, Any]:
    req = {"cpu": cpu, **({"nvidia.com/gpu": gpu} if gpu else {})}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "ml",
                         "annotations": {"bigfleet.lucy.sh/interruption-penalty": "100"}},
            "spec": {"priority": 2000, "nodeSelector": {"pool": "gpu"},
                     "containers": [{"name": "c", "image": "i", "resources": {"requests": req}}]},
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}}


async def test_unschedulable_pods_reach_the_shard_as_one_need(kube: KubeTestServer, api: Any,
                                                              shard: FakeShard) -> None:
    s = kube.store
    ctl = PodController(api)
    op = Operator(OperatorConfig(cluster_id="c1", shard_addr=shard.target, rollup_interval=30.0, debounce=0.05),
                  api, backoff=Backoff(initial=0.05, cap=0.2))
    tasks = [asyncio.create_task(ctl.run()), asyncio.create_task(op.run())]
    try:
        await eventually(lambda: shard.rollups, what="first (empty) roll-up")
        for i in range(3):
            s.put(pending_pod(f"train-{i}", "8", "1"))

        def need() -> capacity_pb2.CapacityNeed | None:
            n = [x for x in (shard.rollups[-1].needs if shard.rollups else []) if x.priority == 2000]
            return n[0] if n and dict(n[0].aggregate_resources).get("cpu") == "24" else None

        n = await eventually(need, what="aggregated need at the shard")
        assert dict(n.aggregate_resources) == {"cpu": "24", "nvidia.com/gpu": "3"}  # type: ignore[union-attr]
        assert dict(n.min_unit) == {"cpu": "8", "nvidia.com/gpu": "1"}  # type: ignore[union-attr]
        assert n.interruption_penalty_bucket == capacity_pb2.PENALTY_BUCKET_128  # type: ignore[union-attr]
        assert [(r.key, list(r.values)) for r in n.requirements] == [("pool", ["gpu"])]  # type: ignore[union-attr]
        # Deleting a pod garbage-collects its CR, and the next roll-up carries less demand.
        s.remove("pods", "train-0", "ml")
        await eventually(lambda: shard.rollups[-1].needs and
                         dict(shard.rollups[-1].needs[0].aggregate_resources).get("cpu") == "16",
                         what="withdrawal reaches the shard")
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
