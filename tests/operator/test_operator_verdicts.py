"""The operator's real code against the k8stest API server and a fake shard: per-need verdicts become
CapacityRequest conditions and deduplicated Events; reclaims raise Node Events; a held roll-up raises
RollupHeld; UpcomingNodes wait for their Node, and a Node that never registers is reported."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from conftest import cr
from fakeshard import FakeShard, eventually

from bigfleet.k8stest import KubeTestServer
from bigfleet.operator.app import Operator, OperatorConfig
from bigfleet.operator.session import Backoff
from bigfleet.v1alpha1 import provider_pb2, shard_pb2, shardread_pb2


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
    cfg = OperatorConfig(cluster_id="c1", shard_addr=shard.target, rollup_interval=30.0, debounce=0.05,
                         eviction_retry=0.1, namespace="bigfleet-system", **kw)
    return Operator(cfg, api, backoff=Backoff(initial=0.05, cap=0.2))


def events(kube: KubeTestServer, reason: str | None = None, name: str | None = None) -> list[dict[str, Any]]:
    out = []
    for ns in ("default", "team2", "bigfleet-system"):
        out += [e for e in kube.store.objects("events", ns)
                if (reason is None or e["reason"] == reason) and (name is None or e["involvedObject"]["name"] == name)]
    return out


def cond(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return dict(c)
    return {}


async def test_verdicts_become_conditions_and_deduplicated_events(kube: KubeTestServer, api: Any,
                                                                   shard: FakeShard) -> None:
    s = kube.store
    s.put(cr("a", {"cpu": "1"}, priority=100))
    s.put(cr("b", {"cpu": "2"}, priority=100, ns="team2"))
    s.put(cr("gpu", {"nvidia.com/gpu": "1"}, priority=100,
             requirements=[{"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["p5.48xlarge"]}]))
    async with running(make_op(api, shard)) as op:
        await eventually(lambda: shard.rollups and "c1" in shard.conns and op.cr_fingerprints, what="a roll-up")
        fp_cpu = op.cr_fingerprints[("default", "a")]
        fp_gpu = op.cr_fingerprints[("default", "gpu")]
        assert op.cr_fingerprints[("team2", "b")] == fp_cpu and fp_gpu != fp_cpu

        def send(gpu_reason: int, deficit: str = "1", bound: int = 1, coming: int = 0, escalated: bool = False) -> None:
            shard.send("c1", shard_pb2.ShardMessage(need_verdicts=shard_pb2.NeedVerdicts(
                supersedes_key="verdicts:c1", cluster_id="c1", cycle=7, computed_at_unix_nanos=1_700_000_000 * 10**9,
                verdicts=[
                    shard_pb2.NeedVerdict(fingerprint=fp_cpu, satisfied=True, machines_bound=bound,
                                          machines_coming=coming),
                    shard_pb2.NeedVerdict(fingerprint=fp_gpu, satisfied=False, unmet_reason=gpu_reason,  # type: ignore[arg-type]
                                          machines_missing=1, shortfall_age_cycles=3, shortfall_age_seconds=30,
                                          escalated=escalated,
                                          deficit=provider_pb2.Resources(resources={"nvidia.com/gpu": deficit}),
                                          matching_supply=shardread_pb2.MatchingSupply()),
                ])))

        send(shardread_pb2.UNMET_REASON_NO_MATCHING_SUPPLY)
        # (the operator writes each CapacityRequest's status on its own: wait for all three)
        await eventually(lambda: all(cond(s.find("capacityrequests", n, ns), "Satisfied")
                                     for n, ns in (("gpu", "default"), ("a", "default"), ("b", "team2"))),
                         what="conditions")
        gpu = s.find("capacityrequests", "gpu", "default")
        assert gpu is not None
        st = gpu["status"]
        assert st["phase"] == "Acknowledged"  # (the acknowledgement is untouched)
        assert cond(gpu, "Satisfied")["status"] == "False" and cond(gpu, "Satisfied")["reason"] == "NoMatchingSupply"
        assert cond(gpu, "Unsatisfied")["status"] == "True"
        assert st["machines"] == {"bound": 0, "coming": 0, "missing": 1}
        assert st["shortfall"]["since"] == "2023-11-14T22:12:50Z" and st["needFingerprint"] == fp_gpu
        assert st["observedGeneration"] == gpu["metadata"]["generation"]
        for name, ns in (("a", "default"), ("b", "team2")):
            o = s.find("capacityrequests", name, ns)
            assert cond(o, "Satisfied")["status"] == "True" and o["status"]["machines"]["bound"] == 1  # type: ignore[index]
        await eventually(lambda: events(kube, "Shortfall"), what="a Shortfall Event")
        await op.events.idle()
        (ev,) = events(kube, "Shortfall")
        assert ev["involvedObject"]["name"] == "gpu" and ev["type"] == "Warning" and ev["count"] == 1
        assert ev["message"].startswith("NoMatchingSupply: no machine of a fitting shape")
        assert events(kube, "Provisioning") == []

        # The same verdicts again, and a deficit change: status follows, no new Event.
        send(shardread_pb2.UNMET_REASON_NO_MATCHING_SUPPLY)
        send(shardread_pb2.UNMET_REASON_NO_MATCHING_SUPPLY, deficit="2")
        await eventually(lambda: "nvidia.com/gpu=2" in cond(s.find("capacityrequests", "gpu", "default"),
                                                              "Satisfied").get("message", ""), what="new message")
        await op.events.idle()
        assert [e["count"] for e in events(kube, "Shortfall")] == [1]
        # Another reason: the same Event object, its count bumped; then escalation; then machines coming.
        send(shardread_pb2.UNMET_REASON_PRIORITY_STARVED, deficit="2")
        await eventually(lambda: [e["count"] for e in events(kube, "Shortfall")] == [2], what="Shortfall count 2")
        assert events(kube, "Shortfall")[0]["message"].startswith("PriorityStarved")
        send(shardread_pb2.UNMET_REASON_PRIORITY_STARVED, deficit="2", escalated=True, coming=2)
        await eventually(lambda: events(kube, "Escalated") and len(events(kube, "Provisioning")) == 2,
                         what="Escalated and Provisioning Events")
        assert {e["involvedObject"]["name"] for e in events(kube, "Provisioning")} == {"a", "b"}
        assert cond(s.find("capacityrequests", "gpu", "default"), "Escalated")["status"] == "True"
        assert s.find("capacityrequests", "a", "default")["status"]["machines"]["coming"] == 2  # type: ignore[index]

        # Reclaims: Events on the Nodes (Preempting for a higher-priority preemptor, else Reclaiming).
        for n in ("node-1", "node-2"):
            s.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}, "spec": {}})
        shard.send("c1", shard_pb2.ShardMessage(reclaim_instruction=shard_pb2.ReclaimInstruction(
            instruction_id="i1", nodes=["node-1"], grace_period_seconds=5, preemptor_priority=1000)))
        shard.send("c1", shard_pb2.ShardMessage(reclaim_instruction=shard_pb2.ReclaimInstruction(
            instruction_id="i2", nodes=["node-2"], grace_period_seconds=5)))
        await eventually(lambda: events(kube, "Preempting", "node-1") and events(kube, "Reclaiming", "node-2"),
                         what="Node Events")
        pre = events(kube, "Preempting", "node-1")[0]
        assert pre["involvedObject"]["kind"] == "Node" and pre["type"] == "Warning" and "1000" in pre["message"]

        # A roll-up the shard's guard holds: RollupHeld on the operator's namespace, deduplicated.
        held_echo = "rollup-held: a collapse of this cluster's demand is held by the empty-roll-up guard until restated"
        for _ in range(2):  # what the shard sends for each held restatement: a flagged ack, then the echo
            shard.send("c1", shard_pb2.ShardMessage(ack=shard_pb2.Acknowledgement(echo="rollup", rollup_held=True)))
            shard.send("c1", shard_pb2.ShardMessage(ack=shard_pb2.Acknowledgement(echo=held_echo)))
        await eventually(lambda: [e.get("count") for e in events(kube, "RollupHeld")] == [2], what="RollupHeld")
        # an echo alone (no flagged ack before it) is a hold too
        shard.send("c1", shard_pb2.ShardMessage(ack=shard_pb2.Acknowledgement(echo="rollup")))
        shard.send("c1", shard_pb2.ShardMessage(ack=shard_pb2.Acknowledgement(echo=held_echo)))
        await eventually(lambda: [e.get("count") for e in events(kube, "RollupHeld")] == [3], what="RollupHeld x3")
        await asyncio.sleep(0.3)
        assert [e.get("count") for e in events(kube, "RollupHeld")] == [3]
        held = events(kube, "RollupHeld")[0]
        assert held["involvedObject"] == {"apiVersion": "v1", "kind": "Namespace", "name": "bigfleet-system"}
        assert held["metadata"]["namespace"] == "bigfleet-system"


async def test_upcoming_node_waits_for_its_node_and_a_node_that_never_registers_is_reported(
        kube: KubeTestServer, api: Any, shard: FakeShard) -> None:
    s = kube.store
    op = make_op(api, shard, node_readiness="node", node_registration_timeout=1.0)
    assert op.tracks_nodes

    def configured(mid: str, node: str, state: int = provider_pb2.MACHINE_STATE_CONFIGURED,
                   err: str = "") -> shard_pb2.ShardMessage:
        return shard_pb2.ShardMessage(node_state_update=shard_pb2.NodeStateUpdate(
            supersedes_key=f"node:{mid}", machine_id=mid, cluster_id="c1", state=state,  # type: ignore[arg-type]
            node_name=node, provider_id=f"fake://{mid}", last_error=err,
            resources=provider_pb2.Resources(resources={"cpu": "4"})))

    def phase(name: str) -> str:
        return str(((s.find("upcomingnodes", name) or {}).get("status") or {}).get("phase"))

    async with running(op):
        await eventually(lambda: "c1" in shard.conns, what="session")
        shard.send("c1", configured("m-1", "node-1"))
        shard.send("c1", configured("m-2", "node-2"))
        await eventually(lambda: phase("un-m-1") == "Joining" and phase("un-m-2") == "Joining", what="Joining")
        st = s.find("upcomingnodes", "un-m-1")["status"]  # type: ignore[index]
        assert st["machineID"] == "m-1" and st["configuredTime"]
        # node-2 registers, NotReady first, then Ready (matched by providerID under another name).
        s.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "ip-10-0-0-2"},
               "spec": {"providerID": "fake://m-2"}, "status": {"conditions": [{"type": "Ready", "status": "False"}]}})
        await eventually(lambda: phase("un-m-2") == "Registered", what="Registered")
        s.update_status("nodes", "ip-10-0-0-2", {"conditions": [{"type": "Ready", "status": "True"}]})
        await eventually(lambda: phase("un-m-2") == "Ready", what="Ready")
        # node-1 never registers: reported to the shard, with a RegistrationTimeout Event.
        await eventually(lambda: shard.registration_timeouts, timeout=10, what="a registration-timeout report")
        r = shard.registration_timeouts[0]
        assert r.machine_id == "m-1" and r.node_name == "node-1" and r.waited_seconds >= 1
        assert all(t.machine_id == "m-1" for t in shard.registration_timeouts)
        await eventually(lambda: events(kube, "RegistrationTimeout", "un-m-1"), what="RegistrationTimeout Event")
        ev = events(kube, "RegistrationTimeout", "un-m-1")[0]
        assert ev["involvedObject"]["kind"] == "UpcomingNode" and ev["type"] == "Warning"
        assert "node-1" in ev["message"] and "replacement" in ev["message"]
        # Until the shard says FAILED the report is repeated (a report can be lost with a session)...
        await eventually(lambda: len(shard.registration_timeouts) >= 2, timeout=10, what="a repeated report")
        assert [e["count"] for e in events(kube, "RegistrationTimeout")] == [1]  # (one Event for the machine)
        # ...then it stops.
        shard.send("c1", configured("m-1", "node-1", provider_pb2.MACHINE_STATE_FAILED,
                                    "RegistrationTimeout: node node-1 did not register within 2s"))
        await eventually(lambda: phase("un-m-1") == "Failed", what="Failed")
        assert s.find("upcomingnodes", "un-m-1")["status"]["lastError"].startswith("RegistrationTimeout")  # type: ignore[index]
        n = len(shard.registration_timeouts)
        await asyncio.sleep(2.5)
        assert len(shard.registration_timeouts) == n
        assert op.metrics.registration_timeouts._value.get() == 1


async def test_a_node_that_registers_but_never_turns_ready_is_reported(
        kube: KubeTestServer, api: Any, shard: FakeShard) -> None:
    s = kube.store
    op = make_op(api, shard, node_readiness="node", node_registration_timeout=60.0, node_ready_timeout=1.0)

    def phase(name: str) -> str:
        return str(((s.find("upcomingnodes", name) or {}).get("status") or {}).get("phase"))

    async with running(op):
        await eventually(lambda: "c1" in shard.conns, what="session")
        shard.send("c1", shard_pb2.ShardMessage(node_state_update=shard_pb2.NodeStateUpdate(
            supersedes_key="node:m-3", machine_id="m-3", cluster_id="c1",
            state=provider_pb2.MACHINE_STATE_CONFIGURED, node_name="node-3", provider_id="fake://m-3",
            resources=provider_pb2.Resources(resources={"cpu": "4"}))))
        s.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-3"},
               "spec": {"providerID": "fake://m-3"}, "status": {"conditions": [{"type": "Ready", "status": "False"}]}})
        await eventually(lambda: phase("un-m-3") == "Registered", what="Registered")
        await eventually(lambda: shard.registration_timeouts, timeout=10, what="a ready-timeout report")
        r = shard.registration_timeouts[0]
        assert r.machine_id == "m-3" and r.node_name == "node-3" and r.waited_seconds >= 1
        await eventually(lambda: events(kube, "ReadyTimeout", "un-m-3"), what="ReadyTimeout Event")
        assert "was not Ready within 1s" in events(kube, "ReadyTimeout", "un-m-3")[0]["message"]


async def test_a_request_joining_an_answered_need_gets_its_status_without_a_new_frame(
        kube: KubeTestServer, api: Any, shard: FakeShard) -> None:
    """The shard sends a cluster's verdicts again only when they change. A CapacityRequest that joins
    a need the last frame answered (and whose extra demand did not change the decision) must still get
    that status, not wait for the next change (`kubectl wait --for=condition=Satisfied` would hang)."""
    s = kube.store
    s.put(cr("a", {"cpu": "1"}, priority=100))
    async with running(make_op(api, shard)) as op:
        await eventually(lambda: ("default", "a") in op.cr_fingerprints and "c1" in shard.conns, what="a roll-up")
        fp = op.cr_fingerprints[("default", "a")]
        shard.send("c1", shard_pb2.ShardMessage(need_verdicts=shard_pb2.NeedVerdicts(
            supersedes_key="verdicts:c1", cluster_id="c1", cycle=3, computed_at_unix_nanos=1_700_000_000 * 10**9,
            verdicts=[shard_pb2.NeedVerdict(fingerprint=fp, satisfied=True, machines_bound=1)])))
        await eventually(lambda: cond(s.find("capacityrequests", "a", "default"), "Satisfied"), what="a's status")
        frames = op.verdict_frames
        rollups = len(shard.rollups)
        s.put(cr("late", {"cpu": "1"}, priority=100))  # the same profile: folded into a's need
        await eventually(lambda: len(shard.rollups) > rollups and op.cr_fingerprints.get(("default", "late")) == fp,
                         what="the roll-up with the new request")
        await eventually(lambda: cond(s.find("capacityrequests", "late", "default"), "Satisfied").get("status") == "True",
                         what="the new request's status from the last frame")
        late = s.find("capacityrequests", "late", "default")
        assert late is not None and late["status"]["machines"]["bound"] == 1
        assert op.verdict_frames == frames + 1  # the last frame applied once more, no new frame from the shard
