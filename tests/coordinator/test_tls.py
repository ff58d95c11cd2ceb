"""A coordinator under mTLS: identities and roles per protocols.md §5.3, bigfleetctl with an admin cert."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from bigfleet.coordclient.client import CoordinatorClient, CoordinatorUnavailable
from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.ctl.main import main as ctl
from bigfleet.security.certs import make_local_pki
from bigfleet.security.tls import TLSConfig, dial
from bigfleet.v1alpha1 import coordinator_pb2 as pb
from bigfleet.v1alpha1 import coordinator_pb2_grpc as pbg

pytestmark = pytest.mark.slow


async def test_roles_and_identities_under_mtls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pki = tmp_path / "pki"
    make_local_pki(pki, shards=["shard-0"], clusters=["cluster-a"])

    def tls(stem: str) -> TLSConfig:
        return TLSConfig.from_paths(pki / f"{stem}.crt", pki / f"{stem}.key", pki / "ca.crt")

    g = CoordGroup(
        tmp_path / "g",
        1,
        extra=("--rebalance-interval", "0", "--tls-cert", str(pki / "admin.crt"), "--tls-key", str(pki / "admin.key"), "--tls-ca", str(pki / "ca.crt")),
    )
    for i in range(g.n):
        g.start(i)
    try:
        await _exercise(g, pki, tls, capsys)
    finally:
        g.stop_all()


async def _exercise(g: CoordGroup, pki: Path, tls: Any, capsys: pytest.CaptureFixture[str]) -> None:
    shard = CoordinatorClient(g.addresses, tls=tls("shard-shard-0"), timeout=3.0)
    cluster = CoordinatorClient(g.addresses, tls=tls("cluster-cluster-a"), timeout=3.0)
    readonly = CoordinatorClient(g.addresses, tls=tls("readonly"), timeout=3.0)
    plain = CoordinatorClient(g.addresses, timeout=2.0)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                await shard.call("ReportShard", pb.ShardReport(shard_id="shard-0", shard_address="s0:7780"))
                break
            except CoordinatorUnavailable:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)

        async def denied(client: CoordinatorClient, method: str, req: object) -> None:
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await client.call(method, req)
            assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED

        await denied(shard, "ReportShard", pb.ShardReport(shard_id="shard-1"))  # only as itself
        await denied(shard, "AssignDomain", pb.AssignDomainRequest(topology_key="k", topology_value="v", shard_id="shard-0"))
        r = await cluster.call("LookupCluster", pb.LookupClusterRequest(cluster_id="cluster-a"))
        assert r.shard_id == "shard-0"
        await denied(cluster, "LookupCluster", pb.LookupClusterRequest(cluster_id="cluster-b"))
        await denied(cluster, "ListShards", pb.ListShardsRequest())
        # readonly sees an existing binding but never places a cluster, whatever role it claims
        assert (await readonly.call("LookupCluster", pb.LookupClusterRequest(cluster_id="cluster-a"))).shard_id == "shard-0"
        async with dial(g.addr(0), tls("readonly")) as ch:
            for md in ((), (("bigfleet-caller-role", "admin"),)):
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await pbg.CoordinatorStub(ch).LookupCluster(
                        pb.LookupClusterRequest(cluster_id="cluster-new"), metadata=md, timeout=5)
                assert ei.value.code() == grpc.StatusCode.NOT_FOUND, ei.value
                assert "readonly" in (ei.value.details() or "")
        assert not (await readonly.call("GetClusterStatus", pb.GetClusterStatusRequest(cluster_id="cluster-new"))).bound
        assert len((await readonly.call("ListShards", pb.ListShardsRequest())).shards) == 1
        await readonly.call("PlanRebalance", pb.PlanRebalanceRequest())
        await denied(readonly, "ApplyRebalance", pb.ApplyRebalanceRequest())
        await denied(readonly, "RemoveShard", pb.RemoveShardRequest(shard_id="shard-0"))
        with pytest.raises(CoordinatorUnavailable):  # no client certificate: the handshake fails
            await plain.call("ListShards", pb.ListShardsRequest())
    finally:
        for c in (shard, cluster, readonly, plain):
            await c.close()

    # bigfleetctl with an admin certificate, then with a readonly one.
    tls_args = ["--tls-cert", str(pki / "admin.crt"), "--tls-key", str(pki / "admin.key"), "--tls-ca", str(pki / "ca.crt")]
    coord = ["--coordinator", g.addr(0)]
    assert await asyncio.to_thread(ctl, [*tls_args, "domains", "assign", "--key", "rack", "--value", "r1", "--shard", "shard-0", *coord]) == 0
    ro = ["--tls-cert", str(pki / "readonly.crt"), "--tls-key", str(pki / "readonly.key"), "--tls-ca", str(pki / "ca.crt")]
    capsys.readouterr()
    assert await asyncio.to_thread(ctl, [*ro, "domains", "unassign", "--key", "rack", "--value", "r1", *coord]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    assert await asyncio.to_thread(ctl, [*ro, "domains", "-o", "json", *coord]) == 0
    assert '"r1"' in capsys.readouterr().out
