"""The operator's real code (official kubernetes.aio client, grpc.aio Session) against the k8stest API
server and a fake shard on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from conftest import cr
from fakeshard import FakeShard, eventually

from bigfleet.k8stest import KubeTestServer
from bigfleet.operator.app import Operator, OperatorConfig
from bigfleet.operator.session import Backoff
from bigfleet.operator.upcoming import available_capacity_name
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2, shard_pb2

FAST = Backoff(initial=0.05, cap=0.2)


@contextlib.asynccontextmanager
async def running(op: Operator) -> AsyncIterator[Operator]:
    task = asyncio.create_task(op.run())
    try:
        yield op
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def make_op(api: Any, shard: FakeShard, **kw: Any) -> Operator:
    cfg = OperatorConfig(cluster_id="c1", shard_addr=shard.target, rollup_interval=kw.pop("rollup_interval", 30.0),
                         debounce=0.05, eviction_retry=0.1, **kw)
    return Operator(cfg, api, backoff=Backoff(initial=0.05, cap=0.2))


def last_needs(shard: FakeShard) -> list[capacity_pb2.CapacityNeed]:
    return list(shard.rollups[-1].needs) if shard.rollups else []


async def test_crs_become_the_exact_rollup_and_are_acknowledged(kube: KubeTestServer, api: Any,
                                                               shard: FakeShard) -> None:
    s = kube.store
    s.put(cr("a", {"cpu": "500m", "memory": "1Gi"}, priority=500, interruptionPenalty="3"))
    s.put(cr("b", {"cpu": "1500m", "memory": "3Gi"}, priority=500, interruptionPenalty="3", ns="team2"))
    async with running(make_op(api, shard)):
        await eventually(lambda: shard.rollups, what="first roll-up")
        assert shard.hellos[0].cluster_id == "c1" and shard.hellos[0].protocol_version == "v1alpha1"
        first = shard.rollups[0]
        assert first.cluster_id == "c1"
        assert len(first.needs) == 1
        n = first.needs[0]
        assert dict(n.aggregate_resources) == {"cpu": "2", "memory": "4Gi"}
        assert dict(n.min_unit) == {"cpu": "1500m", "memory": "3Gi"}
        assert n.priority == 500 and n.interruption_penalty_bucket == capacity_pb2.PENALTY_BUCKET_4
        await eventually(lambda: all((o.get("status") or {}).get("phase") == "Acknowledged"
                                     for o in s.objects("capacityrequests")), what="CRs acknowledged")
        assert all(o["status"].get("acknowledgedAt") for o in s.objects("capacityrequests"))

        # A change is rolled up on its own (well before the 30 s interval); deletion withdraws demand.
        s.put(cr("c", {"nvidia.com/gpu": "8"}, priority=900))
        await eventually(lambda: any(nd.priority == 900 for nd in last_needs(shard)), what="roll-up with c")
        s.remove("capacityrequests", "a", "default")
        s.remove("capacityrequests", "b", "team2")
        await eventually(lambda: [nd.priority for nd in last_needs(shard)] == [900], what="withdrawal")


async def test_bootstrap_round_trip_and_unsatisfiable_error(kube: KubeTestServer, api: Any,
                                                           shard: FakeShard) -> None:
    tmpl = ("#cloud-config\n# cluster={{ ClusterID }} token={{ JoinToken }}\n"
            "{% for r in Requirements %}{% if r.Key == 'arch' and 'arm64' in r.Values %}"
            "{{ fail('no arm64 node image in this cluster') }}{% endif %}"
            "# {{ r.Key }} {{ r.Operator }} {{ r.Values | join(',') }}\n{% endfor %}")
    op = make_op(api, shard, bootstrap_template=tmpl, join_token="abc.123")
    async with running(op):
        await eventually(lambda: "c1" in shard.conns, what="session")
        shard.send("c1", shard_pb2.ShardMessage(bootstrap_request=shard_pb2.BootstrapRequest(
            request_id="00112233aabbccdd", cluster_id="c1",
            requirements=[capacity_pb2.NodeSelectorRequirement(
                key="zone", operator=capacity_pb2.NodeSelectorRequirement.OPERATOR_IN, values=["a", "b"])])))
        await eventually(lambda: shard.bootstrap_responses, what="bootstrap response")
        r = shard.bootstrap_responses[0]
        assert r.request_id == "00112233aabbccdd" and not r.error
        assert r.user_data.decode() == "#cloud-config\n# cluster=c1 token=abc.123\n# zone In a,b\n"
        shard.send("c1", shard_pb2.ShardMessage(bootstrap_request=shard_pb2.BootstrapRequest(
            request_id="ffff", cluster_id="c1",
            requirements=[capacity_pb2.NodeSelectorRequirement(
                key="arch", operator=capacity_pb2.NodeSelectorRequirement.OPERATOR_IN, values=["arm64"])])))
        await eventually(lambda: len(shard.bootstrap_responses) == 2, what="second response")
        r2 = shard.bootstrap_responses[1]
        assert r2.request_id == "ffff" and r2.error == "no arm64 node image in this cluster" and not r2.user_data


def nsu(mid: str, state: int, **kw: Any) -> shard_pb2.ShardMessage:
    return shard_pb2.ShardMessage(node_state_update=shard_pb2.NodeStateUpdate(
        supersedes_key=f"node:{mid}", machine_id=mid, state=state, **kw))  # type: ignore[arg-type]


async def test_upcoming_node_lifecycle(kube: KubeTestServer, api: Any, shard: FakeShard) -> None:
    s = kube.store
    ms = provider_pb2
    async with running(make_op(api, shard)) as op:
        await eventually(lambda: "c1" in shard.conns, what="session")
        shard.send("c1", nsu("m-1", ms.MACHINE_STATE_CREATING, labels={"zone": "a"},
                             resources=provider_pb2.Resources(resources={"cpu": "4000m", "memory": "16Gi"})))
        un = await eventually(lambda: s.find("upcomingnodes", "un-m-1"), what="UpcomingNode created")
        await eventually(lambda: (s.find("upcomingnodes", "un-m-1") or {}).get("status", {}).get("phase")
                         == "Provisioning", what="Provisioning")
        assert un["spec"] == {"labels": {"zone": "a"}, "resources": {"cpu": "4", "memory": "16Gi"}}
        for state, phase in [(ms.MACHINE_STATE_IDLE, "Launched"), (ms.MACHINE_STATE_CONFIGURING, "Registered")]:
            shard.send("c1", nsu("m-1", state, labels={"zone": "a"},
                                 resources=provider_pb2.Resources(resources={"cpu": "4"})))
            await eventually(lambda p=phase: s.find("upcomingnodes", "un-m-1")["status"]["phase"] == p, what=phase)
        shard.send("c1", nsu("m-1", ms.MACHINE_STATE_CONFIGURED, node_name="node-1", provider_id="fake://m-1",
                             labels={"zone": "a"}, resources=provider_pb2.Resources(resources={"cpu": "4"})))
        await eventually(lambda: s.find("upcomingnodes", "un-m-1")["status"]["phase"] == "Ready", what="Ready")
        obj = s.find("upcomingnodes", "un-m-1")
        assert obj["status"]["nodeRef"] == {"kind": "Node", "name": "node-1"}
        assert obj["status"]["providerID"] == "fake://m-1"
        assert obj["status"]["provisioningStartTime"]
        assert obj["spec"]["resources"] == {"cpu": "4"}  # memory vanished from the frame: removed
        shard.send("c1", nsu("m-1", ms.MACHINE_STATE_DRAINING, node_name="node-1"))
        await eventually(lambda: s.find("upcomingnodes", "un-m-1")["status"]["phase"] == "Draining", what="Draining")
        shard.send("c1", nsu("m-1", ms.MACHINE_STATE_IDLE))
        await eventually(lambda: s.find("upcomingnodes", "un-m-1") is None, what="deleted after drain")
        handled = op.session.coalescer.handled
        shard.send("c1", nsu("m-1", ms.MACHINE_STATE_IDLE))  # a replayed Idle (resync) does not resurrect it
        await eventually(lambda: op.session.coalescer.handled > handled, what="replayed Idle handled")
        # A failed machine keeps its error.
        shard.send("c1", nsu("Weird_ID.7", ms.MACHINE_STATE_FAILED, last_error="boom"))
        assert s.find("upcomingnodes", "un-m-1") is None
        failed = await eventually(lambda: [o for o in s.objects("upcomingnodes")
                                           if (o.get("status") or {}).get("phase") == "Failed"], what="Failed")
        assert failed[0]["status"]["lastError"] == "boom"  # type: ignore[index]
        assert failed[0]["metadata"]["name"].startswith("un-weird-id.7-")  # type: ignore[index]


async def test_available_capacity_written_under_hashed_name(kube: KubeTestServer, api: Any,
                                                            shard: FakeShard) -> None:
    s = kube.store
    key = "available:ab/cd:ef"
    async with running(make_op(api, shard)):
        await eventually(lambda: "c1" in shard.conns, what="session")
        for count, conf in [(3, shard_pb2.AvailableCapacityUpdate.CONFIDENCE_HIGH),
                            (0, shard_pb2.AvailableCapacityUpdate.CONFIDENCE_NONE)]:
            shard.send("c1", shard_pb2.ShardMessage(available_capacity=shard_pb2.AvailableCapacityUpdate(
                supersedes_key=key, available_count=count, confidence=conf, cost_per_hour=1.25,
                resources=provider_pb2.Resources(resources={"cpu": "8"}),
                requirements=[capacity_pb2.NodeSelectorRequirement(
                    key="zone", operator=capacity_pb2.NodeSelectorRequirement.OPERATOR_IN, values=["a"])])))
            await eventually(lambda c=count: ((s.find("availablecapacities", available_capacity_name(key)) or {})
                                              .get("spec", {}).get("availableCount")) == c, what=f"count {count}")
        spec = s.find("availablecapacities", available_capacity_name(key))["spec"]  # type: ignore[index]
        assert spec == {"availability": "None", "availableCount": 0, "cost": "1250m",
                        "requirements": [{"key": "zone", "operator": "In", "values": ["a"]}],
                        "resources": {"cpu": "8"}}
        assert available_capacity_name(key).startswith("ac-") and len(available_capacity_name(key)) == 19


async def test_reclaim_cordons_acks_and_drains_with_a_blocking_pdb(kube: KubeTestServer, api: Any,
                                                                   shard: FakeShard) -> None:
    s = kube.store
    s.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}, "spec": {}})
    s.put({"apiVersion": "bigfleet.lucy.sh/v1alpha1", "kind": "UpcomingNode", "metadata": {"name": "un-m-1"},
           "spec": {"resources": {"cpu": "4"}}, "status": {"phase": "Ready", "nodeRef": {"name": "node-1"}}})
    for i, app in enumerate(["web", "db", "db"]):
        s.put({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"p{i}", "namespace": "default", "labels": {"app": app}},
               "spec": {"nodeName": "node-1" if i < 2 else "node-2", "containers": [{"name": "c", "image": "i"}]},
               "status": {"phase": "Running"}})
    s.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "ds", "namespace": "default", "ownerReferences": [
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent", "uid": "u1"}]},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "i"}]}, "status": {"phase": "Running"}})
    # db needs 2 healthy pods: evicting p1 (db on node-1) would violate it.
    s.put({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "db", "namespace": "default"},
           "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "db"}}}})
    async with running(make_op(api, shard)):
        await eventually(lambda: "c1" in shard.conns, what="session")
        shard.send("c1", shard_pb2.ShardMessage(reclaim_instruction=shard_pb2.ReclaimInstruction(
            instruction_id="0123456789abcdef", nodes=["node-1", "node-gone"], grace_period_seconds=2)))
        await eventually(lambda: shard.reclaim_acks, what="reclaim ack")
        assert shard.reclaim_acks[0].instruction_id == "0123456789abcdef"
        assert shard.reclaim_acks[0].nodes_started == 1  # node-gone does not exist
        assert s.find("nodes", "node-1")["spec"]["unschedulable"] is True  # type: ignore[index]
        await eventually(lambda: s.find("pods", "p0", "default") is None, what="web pod evicted")
        await eventually(lambda: (s.find("upcomingnodes", "un-m-1") or {}).get("status", {}).get("phase") == "Failed",
                         timeout=15, what="drain deadline")
        assert s.find("pods", "p1", "default") is not None  # the PDB held
        assert s.find("pods", "ds", "default") is not None  # DaemonSet pods are left alone
        assert "PodDisruptionBudget" in s.find("upcomingnodes", "un-m-1")["status"]["lastError"]  # type: ignore[index]
        assert s.requests.get("POST /api/v1/namespaces/default/pods/p1/eviction", 0) >= 2  # retried on 429

        # Once the budget allows it, a second reclaim drains the node completely and deletes the UpcomingNode.
        s.remove("poddisruptionbudgets", "db", "default")
        s.update_status("upcomingnodes", "un-m-1", {"phase": "Ready", "lastError": None})
        shard.send("c1", shard_pb2.ShardMessage(reclaim_instruction=shard_pb2.ReclaimInstruction(
            instruction_id="fedcba9876543210", nodes=["node-1"], grace_period_seconds=10)))
        await eventually(lambda: s.find("upcomingnodes", "un-m-1") is None, what="drained and deleted")
        assert s.find("pods", "p1", "default") is None


async def test_a_drain_interrupted_by_a_restart_is_resumed_until_its_deadline(kube: KubeTestServer, api: Any,
                                                                           shard: FakeShard) -> None:
    """A previous operator process cordoned the nodes, marked their UpcomingNodes Draining with the
    deadline and died: the new leader finishes the drain (or fails it with the reason at the deadline)."""
    from bigfleet.operator.handlers import rfc3339

    s = kube.store
    for node, left in (("node-1", 30.0), ("node-2", -5.0)):
        s.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}, "spec": {"unschedulable": True}})
        s.put({"apiVersion": "bigfleet.lucy.sh/v1alpha1", "kind": "UpcomingNode", "metadata": {"name": f"un-{node}"},
               "spec": {"resources": {"cpu": "4"}},
               "status": {"phase": "Draining", "nodeRef": {"name": node}, "drainDeadline": rfc3339(time.time() + left)}})
        s.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p-{node}", "namespace": "default",
                                                              "labels": {"app": node}},
               "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i"}]}, "status": {"phase": "Running"}})
    # A Draining UpcomingNode without a recorded deadline (the shard's own frame) is left to the shard.
    s.put({"apiVersion": "bigfleet.lucy.sh/v1alpha1", "kind": "UpcomingNode", "metadata": {"name": "un-node-3"},
           "spec": {}, "status": {"phase": "Draining", "nodeRef": {"name": "node-3"}}})
    s.put({"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "n2", "namespace": "default"},
           "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "node-2"}}}})
    async with running(make_op(api, shard)) as op:
        await eventually(lambda: s.find("upcomingnodes", "un-node-1") is None, what="node-1 drained and done")
        assert s.find("pods", "p-node-1", "default") is None
        failed = await eventually(lambda: (s.find("upcomingnodes", "un-node-2") or {}).get("status", {})
                                  .get("phase") == "Failed", what="node-2 failed at its passed deadline")
        assert failed and "PodDisruptionBudget" in s.find("upcomingnodes", "un-node-2")["status"]["lastError"]  # type: ignore[index]
        assert s.find("pods", "p-node-2", "default") is not None
        assert s.find("upcomingnodes", "un-node-3")["status"]["phase"] == "Draining"  # type: ignore[index]
        assert not op.writer.draining


async def test_watch_expiry_forces_a_relist_and_nothing_is_missed(kube: KubeTestServer, api: Any,
                                                                  shard: FakeShard) -> None:
    s = kube.store
    s.put(cr("a", {"cpu": "1"}))
    op = make_op(api, shard)
    async with running(op):
        await eventually(lambda: shard.rollups, what="first roll-up")
        assert op.crs.relists == 1
        await eventually(lambda: s.watcher_count("capacityrequests") >= 1, what="watch open")
        s.expire_watches()
        s.put(cr("b", {"cpu": "2"}))  # written while the informer is between watches
        await eventually(lambda: op.crs.relists >= 2, what="re-list after 410")
        await eventually(lambda: [dict(n.aggregate_resources) for n in last_needs(shard)] == [{"cpu": "3"}],
                         what="roll-up includes b")


async def test_shard_restart_reconnects_with_fresh_hello_and_rollup(kube: KubeTestServer, api: Any) -> None:
    s = kube.store
    s.put(cr("a", {"cpu": "1"}))
    shard = await FakeShard().start()
    op = make_op(api, shard)
    async with running(op):
        await eventually(lambda: shard.rollups, what="first roll-up")
        port = shard.port
        await shard.stop()
        # While the shard is down nothing in the cluster changes, and demand keeps being tracked.
        s.put(cr("b", {"cpu": "1"}))
        await eventually(lambda: op.metrics.reconnects._value.get() >= 2, what="reconnect attempts")
        await eventually(lambda: op.crs.get("default", "b"), what="b in the informer cache")
        assert s.find("capacityrequests", "b", "default").get("status") is None  # type: ignore[union-attr]
        shard2 = await FakeShard(port).start()
        try:
            await eventually(lambda: shard2.rollups, what="roll-up after restart")
            assert shard2.hellos[0].cluster_id == "c1"
            assert dict(shard2.rollups[0].needs[0].aggregate_resources) == {"cpu": "2"}
        finally:
            await shard2.stop()


async def test_redirect_trailer_is_followed(kube: KubeTestServer, api: Any, shard: FakeShard) -> None:
    other = await FakeShard().start()
    try:
        op = make_op(api, shard)
        op.session.backoff = Backoff(initial=30, cap=30)  # a redirect must not wait for the backoff
        async with running(op):
            await eventually(lambda: "c1" in shard.conns, what="session on first shard")
            # The first shard steps down: it closes the live session with a redirect, and refuses
            # new ones with it, as a follower does. (The close's trailer can be lost to a write
            # racing it; the operator then asks again at once and gets the refusal whole.)
            shard.refuse_with_redirect = other.target
            shard.close_with("c1", grpc.StatusCode.UNAVAILABLE, "not the leader",
                             (("bigfleet-redirect", other.target),))
            await eventually(lambda: other.rollups, timeout=10, what="session on the redirect target")
    finally:
        await other.stop()


async def test_a_session_whose_status_was_lost_asks_again_at_once(kube: KubeTestServer, api: Any,
                                                                  shard: FakeShard) -> None:
    """A live session ending INTERNAL without trailers (what grpc-aio reports when a write races the
    shard closing the stream) is retried at once, not after the backoff: a shard that stepped down
    then refuses the Hello with its redirect."""
    other = await FakeShard().start()
    try:
        op = make_op(api, shard)
        op.session.backoff = Backoff(initial=30, cap=30)
        async with running(op):
            await eventually(lambda: "c1" in shard.conns, what="session on first shard")
            shard.refuse_with_redirect = other.target
            shard.close_with("c1", grpc.StatusCode.INTERNAL, "Internal error from Core")
            await eventually(lambda: other.rollups, timeout=10, what="session on the redirect target")
    finally:
        await other.stop()


async def test_a_dead_redirect_target_falls_back_to_the_configured_address(kube: KubeTestServer, api: Any,
                                                                         shard: FakeShard) -> None:
    """--shard-addr names a follower, whose redirect leads to the leader. The leader is killed and the
    follower is elected: the operator must not redial the dead leader forever, but go back to the
    address it was given."""
    leader = await FakeShard().start()
    try:
        shard.refuse_with_redirect = leader.target
        op = make_op(api, shard)
        async with running(op):
            await eventually(lambda: leader.rollups, timeout=10, what="session on the redirect target")
            await leader.stop()  # kill -9 of the leader
            shard.refuse_with_redirect = ""  # the configured replica leads now
            await eventually(lambda: "c1" in shard.conns and shard.rollups, timeout=10,
                             what="session back on the configured address")
    finally:
        await leader.stop()


async def test_a_dropped_session_on_a_redirect_target_asks_the_configured_address(kube: KubeTestServer, api: Any,
                                                                                 shard: FakeShard) -> None:
    """A session on the leader a redirect named ends UNAVAILABLE without a redirect (the keepalive gave
    up on a frozen leader): the next attempt asks the configured address, not the old leader (whose
    connect alone would take the whole connect timeout when it is frozen)."""
    leader = await FakeShard().start()
    try:
        shard.refuse_with_redirect = leader.target
        op = make_op(api, shard)
        op.session.backoff = Backoff(initial=0.2, cap=0.2)
        async with running(op):
            await eventually(lambda: "c1" in leader.conns and leader.rollups, timeout=10, what="session on the leader")
            shard.refuse_with_redirect = ""  # the configured replica leads now; the old leader still accepts
            hellos = len(leader.hellos)
            leader.close_with("c1", grpc.StatusCode.UNAVAILABLE, "Stream removed (ping timeout)")
            await eventually(lambda: "c1" in shard.conns and shard.rollups, timeout=10,
                             what="session on the configured address")
            assert len(leader.hellos) == hellos  # the old leader was not asked again
    finally:
        await leader.stop()


async def test_a_redirect_back_to_a_former_session_target_is_followed(kube: KubeTestServer, api: Any,
                                                                     shard: FakeShard) -> None:
    """After falling back to the configured address, its redirect to the leader the operator had a
    session on before (re-elected once it restarted) is followed, not ignored."""
    leader = await FakeShard().start()
    try:
        shard.refuse_with_redirect = leader.target
        op = make_op(api, shard)
        async with running(op):
            await eventually(lambda: leader.rollups, timeout=10, what="session on the redirect target")
            port = leader.port
            await leader.stop()
            hellos = len(shard.hellos)
            await eventually(lambda: len(shard.hellos) > hellos, timeout=10, what="fallback to the configured address")
            leader = await FakeShard(port).start()  # restarted, and leading again
            await eventually(lambda: leader.rollups, timeout=10, what="session on the restarted leader")
    finally:
        await leader.stop()


def test_static_resolver_keeps_a_redirect_until_it_fails() -> None:
    from bigfleet.operator.session import StaticResolver

    r = StaticResolver("follower:1")
    r.redirect("leader:1")
    assert asyncio.run(r.resolve()) == "leader:1"
    assert asyncio.run(r.resolve()) == "leader:1"  # a dropped session redials the leader directly
    r.failed("follower:1")
    assert asyncio.run(r.resolve()) == "leader:1"
    r.failed("leader:1")
    assert asyncio.run(r.resolve()) == "follower:1"
    r.redirect("follower:1")
    assert asyncio.run(r.resolve()) == "follower:1"


@pytest.mark.parametrize("seed", [1, 2])
def test_backoff_doubles_caps_and_jitters(seed: int) -> None:
    import random

    b = Backoff(rng=random.Random(seed))
    delays = [b.next() for _ in range(12)]
    assert 0.4 <= delays[0] <= 0.6
    assert all(d <= 30.0 for d in delays)
    assert delays[-1] >= 24.0
    assert 0.8 <= delays[1] <= 1.2
    b.reset()
    assert b.next() <= 0.6


async def test_mtls_session_presents_the_cluster_identity(kube: KubeTestServer, api: Any, tmp_path: Any) -> None:
    from bigfleet.security.certs import make_local_pki
    from bigfleet.security.tls import TLSConfig

    files = make_local_pki(tmp_path / "pki", clusters=("c1",), shards=("shard-0",))
    d = tmp_path / "pki"
    shard_tls = TLSConfig.from_paths(d / "shard-shard-0.crt", d / "shard-shard-0.key", d / "ca.crt")
    op_tls = TLSConfig.from_paths(d / "cluster-c1.crt", d / "cluster-c1.key", d / "ca.crt")
    assert files
    shard = await FakeShard().start(tls=shard_tls)
    try:
        op = make_op(api, shard)
        op.session.tls = op_tls
        async with running(op):
            await eventually(lambda: shard.rollups, what="roll-up over mTLS")
        assert shard.peers == ["bigfleet://cluster/c1"]
    finally:
        await shard.stop()


async def test_outbox_drops_the_newest_when_full_and_rollup_slot_keeps_the_newest() -> None:
    from bigfleet.operator.metrics import OperatorMetrics
    from bigfleet.operator.session import OUTBOX_CAPACITY, SessionClient, StaticResolver

    m = OperatorMetrics()

    async def nothing() -> None:
        return None

    sc = SessionClient("c1", StaticResolver("127.0.0.1:1"), None, m, request_rollup=nothing)  # type: ignore[arg-type]
    for i in range(OUTBOX_CAPACITY + 3):
        sc.send_response(shard_pb2.OperatorMessage(reclaim_ack=shard_pb2.ReclaimAck(instruction_id=str(i))))
    assert len(sc._outbox) == OUTBOX_CAPACITY
    assert sc._outbox[-1].reclaim_ack.instruction_id == str(OUTBOX_CAPACITY - 1)
    assert m.outbox_dropped._value.get() == 3
    sc.offer_rollup(capacity_pb2.ClusterCapacityNeeds(cluster_id="c1", timestamp_unix_nanos=1))
    sc.offer_rollup(capacity_pb2.ClusterCapacityNeeds(cluster_id="c1", timestamp_unix_nanos=2))
    assert sc._rollup is not None and sc._rollup.timestamp_unix_nanos == 2


async def test_coalescer_keeps_only_the_newest_frame_per_machine() -> None:
    from bigfleet.operator.session import NodeStateCoalescer

    seen: list[tuple[str, int]] = []
    gate = asyncio.Event()

    async def handler(u: shard_pb2.NodeStateUpdate) -> None:
        await gate.wait()
        seen.append((u.machine_id, int(u.state)))

    c = NodeStateCoalescer(handler, asyncio.Semaphore(32))
    for state in (1, 2, 3, 4, 5):  # the first one starts the worker; 2..4 are superseded by 5
        c.offer(shard_pb2.NodeStateUpdate(machine_id="m", state=state))  # type: ignore[arg-type]
        await asyncio.sleep(0)
    c.offer(shard_pb2.NodeStateUpdate(machine_id="other", state=3))  # type: ignore[arg-type]
    gate.set()
    await c.idle()
    assert [s for m, s in seen if m == "m"] == [1, 5]
    assert ("other", 3) in seen and not c.running
