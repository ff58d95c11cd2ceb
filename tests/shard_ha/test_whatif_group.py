"""What-if and the consolidation plan on the Helm default topology (a 3-replica shard group as real
processes): a follower answers UNAVAILABLE with the leader in ``bigfleet-redirect``, and bigfleetctl
and the operator's dry-run client follow it to the leader, which answers."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest

from bigfleet.operator.whatif import DryRuns
from bigfleet.rpc import insecure_channel
from bigfleet.v1alpha1 import shardread_pb2, shardread_pb2_grpc

from .group import Group, need, until

pytestmark = pytest.mark.slow

REQUEST = """\
apiVersion: bigfleet.lucy.sh/v1alpha1
kind: CapacityRequest
metadata: {name: web, namespace: shop}
spec: {priority: 100, resources: {cpu: "1"}}
"""


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bigfleet.ctl.main", *args], capture_output=True, text=True,
                          timeout=60, check=False)


async def test_followers_redirect_whatif_to_the_leader() -> None:
    g = await Group(provider_args=("--seed-count", "2", "--committed-count", "2")).start()
    try:
        leader = await g.leader()

        async def reconciled() -> bool:
            async with insecure_channel(leader.listen) as ch:
                c = await shardread_pb2_grpc.ShardReadStub(ch).GetInventoryCounts(
                    shardread_pb2.InventoryCountsRequest(), timeout=2)
                return bool(c.reconciled)
        await until(reconciled, 60, "leader reconciled")
        follower = next(r for r in g.replicas if r is not leader)
        # the raw answer: UNAVAILABLE + the leader's address
        async with insecure_channel(follower.listen) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await shardread_pb2_grpc.ShardReadStub(ch).WhatIf(
                    shardread_pb2.WhatIfRequest(cluster_id="c1", needs=[need("1")]), timeout=5)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        assert dict(exc.value.trailing_metadata() or ())["bigfleet-redirect"] == leader.listen
        # bigfleetctl pointed at the follower gets the leader's answer
        f = Path(tempfile.mkdtemp()) / "req.yaml"
        f.write_text(REQUEST)
        out = await asyncio.to_thread(ctl, "whatif", "-f", str(f), "--cluster", "c1", "--shard", follower.listen,
                                      "-o", "json")
        assert out.returncode == 0, out.stderr
        ans = json.loads(out.stdout)["answers"]
        assert [a["requests"] for a in ans] == [["shop/web"]] and ans[0]["satisfiable"]
        # so does the operator's dry-run client
        dry = DryRuns("c1", lambda: [], resolve=lambda: _addr(follower.listen), patch=_no_patch)
        resp = await dry.ask([need("1")])
        assert len(resp.answers) == 1 and resp.answers[0].outcome != shardread_pb2.WHAT_IF_OUTCOME_UNSATISFIABLE
        plan = await asyncio.to_thread(ctl, "consolidation", "--plan", "--shard", follower.listen, "-o", "json")
        assert plan.returncode == 0 and json.loads(plan.stdout) == [], plan.stderr
    except BaseException:
        g.stop(dump=True)
        raise
    finally:
        await g.close()


async def _addr(a: str) -> str:
    return a


async def _no_patch(ns: str, name: str, value: object) -> None:
    return None
