"""Two operator replicas and a coordination.k8s.io/v1 Lease: never two Sessions at once."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from conftest import cr
from fakeshard import FakeShard, eventually

from bigfleet.k8stest import KubeTestServer
from bigfleet.operator.app import Operator, OperatorConfig
from bigfleet.operator.leader import LeaseRecord, may_take
from bigfleet.operator.session import Backoff


def test_may_take_rules() -> None:
    held = LeaseRecord("a", 15, "", "", 0)
    assert may_take(None, "b", 0.0, 0.0, 15)
    assert may_take(LeaseRecord("", 1, "", "", 0), "b", 0.0, 0.0, 15)
    assert may_take(held, "a", 0.0, 1.0, 15)  # renewing one's own lease
    assert not may_take(held, "b", 100.0, 114.9, 15)  # unchanged for less than the duration
    assert may_take(held, "b", 100.0, 115.0, 15)


def replica(api: Any, shard: FakeShard, ident: str) -> Operator:
    cfg = OperatorConfig(cluster_id="c1", shard_addr=shard.target, rollup_interval=30.0, debounce=0.05,
                         leader_elect=True, identity=ident, namespace="default",
                         lease_duration=3.0, renew_deadline=2.0, retry_period=0.25)
    return Operator(cfg, api, backoff=Backoff(initial=0.05, cap=0.2))


async def test_one_replica_streams_and_the_standby_takes_over(kube: KubeTestServer, api: Any,
                                                              shard: FakeShard) -> None:
    s = kube.store
    s.put(cr("a", {"cpu": "1"}))
    a, b = replica(api, shard, "replica-a"), replica(api, shard, "replica-b")
    ta = asyncio.create_task(a.run())
    await eventually(lambda: a.elector is not None and a.elector.leading.is_set(), what="a leads")
    tb = asyncio.create_task(b.run())
    try:
        await eventually(lambda: shard.rollups, what="roll-up from the leader")
        # b keeps polling the Lease (several renew periods) and must stay a standby meanwhile.
        polls = kube.store.requests.get("GET /apis/coordination.k8s.io/v1/namespaces/default/leases/bigfleet-operator", 0)
        await eventually(lambda: kube.store.requests.get(
            "GET /apis/coordination.k8s.io/v1/namespaces/default/leases/bigfleet-operator", 0) >= polls + 8,
            what="several Lease polls")
        assert b.elector is not None and not b.elector.leading.is_set()
        assert shard.sessions_opened == 1 and shard.max_active == 1
        lease = s.find("leases", "bigfleet-operator", "default")
        assert lease is not None and lease["spec"]["holderIdentity"] == "replica-a"

        # Clean shutdown of the leader releases the Lease: b takes over without waiting for expiry.
        ta.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ta
        await eventually(lambda: b.elector is not None and b.elector.leading.is_set(), timeout=10, what="b leads")
        await eventually(lambda: shard.sessions_opened == 2, what="b's session")
        assert shard.max_active == 1
        assert s.find("leases", "bigfleet-operator", "default")["spec"]["holderIdentity"] == "replica-b"  # type: ignore[index]
    finally:
        for t in (ta, tb):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t


async def test_a_leader_that_cannot_renew_stops_before_anyone_else_starts(kube: KubeTestServer, api: Any,
                                                                         shard: FakeShard) -> None:
    a, b = replica(api, shard, "replica-a"), replica(api, shard, "replica-b")
    ta = asyncio.create_task(a.run())
    await eventually(lambda: a.elector is not None and a.elector.leading.is_set(), what="a leads")
    tb = asyncio.create_task(b.run())
    try:
        await eventually(lambda: "c1" in shard.conns, what="a's session")
        # The API server refuses every Lease write for a while: a must give up leadership (and its
        # Session) after renew_deadline, and b may only start after lease_duration without change.
        kube.fail_next("PUT", "/leases/bigfleet-operator", 503, times=14)
        await eventually(lambda: not a.elector.leading.is_set(), timeout=10, what="a steps down")  # type: ignore[union-attr]
        await eventually(lambda: b.elector.leading.is_set() or a.elector.leading.is_set(),  # type: ignore[union-attr]
                         timeout=30, what="a new leader once writes succeed")
        await eventually(lambda: shard.sessions_opened >= 2, what="new session")
        assert shard.max_active == 1
    finally:
        for t in (ta, tb):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
