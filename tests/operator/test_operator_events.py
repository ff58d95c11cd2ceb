"""Event dedupe and rate limits (pure correlator, then the recorder against the k8stest API server),
the conditions a verdict maps to, and operator and shard agreeing on need fingerprints."""

from __future__ import annotations

from typing import Any

from conftest import cr
from kubernetes.aio import client

from bigfleet.k8stest import KubeTestServer
from bigfleet.operator.conditions import plan_status
from bigfleet.operator.events import NORMAL, WARNING, EventCorrelator, EventRecorder, ObjectRef
from bigfleet.operator.metrics import OperatorMetrics
from bigfleet.operator.nodes import NodeIndex, due_timeouts, node_ready, parse_duration
from bigfleet.operator.rollup import build_rollup, demand_fingerprint
from bigfleet.v1alpha1 import shard_pb2, shardread_pb2
from bigfleet.wire.needs import rollup_from_proto

REF = ObjectRef("bigfleet.lucy.sh/v1alpha1", "CapacityRequest", "a", "default", "uid-a")


def names(n: int = 1000) -> Any:
    it = iter(range(n))
    return lambda ref: f"{ref.name}.{next(it)}"


def test_same_reason_and_object_bumps_the_count_instead_of_a_new_event() -> None:
    c = EventCorrelator()
    name = names()
    first = c.decide(REF, WARNING, "Shortfall", 0.0, "T0", name)
    assert first is not None and not first.update and first.count == 1
    again = c.decide(REF, WARNING, "Shortfall", 1.0, "T1", name)
    assert again is not None and again.update and again.name == first.name and again.count == 2
    assert again.first_timestamp == "T0"
    # another reason, type or object is another Event
    other = c.decide(REF, NORMAL, "Provisioning", 2.0, "T2", name)
    assert other is not None and not other.update and other.name != first.name
    b = ObjectRef(REF.api_version, REF.kind, "b", "default")
    assert not c.decide(b, WARNING, "Shortfall", 3.0, "T3", name).update  # type: ignore[union-attr]


def test_per_object_token_bucket_like_client_go() -> None:
    c = EventCorrelator(per_object_burst=25, per_object_rate=1 / 300, qps=1000, burst=1000)
    name = names()
    got = [c.decide(REF, WARNING, f"R{i}", 0.0, "T", name) for i in range(30)]
    assert sum(e is not None for e in got) == 25 and got[25] is None
    # another object has its own bucket
    b = ObjectRef(REF.api_version, REF.kind, "b", "default")
    assert c.decide(b, WARNING, "R", 0.0, "T", name) is not None
    # one token back every 5 minutes
    assert c.decide(REF, WARNING, "R0", 299.0, "T", name) is None
    assert c.decide(REF, WARNING, "R0", 301.0, "T", name) is not None


def test_global_bucket_spares_the_object_bucket() -> None:
    c = EventCorrelator(qps=1, burst=2)
    name = names()
    refs = [ObjectRef("v1", "Node", f"n{i}") for i in range(4)]
    got = [c.decide(r, NORMAL, "Reclaiming", 0.0, "T", name) for r in refs]
    assert [g is not None for g in got] == [True, True, False, False]
    assert c.buckets[refs[2].key].tokens == 25  # (the refusal was not that node's doing)
    assert c.decide(refs[2], NORMAL, "Reclaiming", 1.0, "T", name) is not None


async def test_recorder_writes_one_event_object_and_bumps_it(kube: KubeTestServer, api: Any) -> None:
    m = OperatorMetrics()
    rec = EventRecorder(client.CoreV1Api(api), m, identity="op-1")
    for i in range(3):
        assert await rec.write(REF, WARNING, "Shortfall", f"short {i}") == ("created" if i == 0 else "updated")
    evs = kube.store.objects("events", "default")
    assert len(evs) == 1
    e = evs[0]
    assert e["count"] == 3 and e["message"] == "short 2" and e["reason"] == "Shortfall" and e["type"] == "Warning"
    assert e["involvedObject"] == {"apiVersion": "bigfleet.lucy.sh/v1alpha1", "kind": "CapacityRequest", "name": "a",
                                   "namespace": "default", "uid": "uid-a"}
    assert e["firstTimestamp"] and e["lastTimestamp"] and e["source"] == {"component": "bigfleet-operator"}
    # The Event expired (deleted): the next repeat creates a fresh one instead of failing.
    kube.store.remove("events", e["metadata"]["name"], "default")
    assert await rec.write(REF, WARNING, "Shortfall", "short 3") == "created"
    evs = kube.store.objects("events", "default")
    assert len(evs) == 1 and evs[0]["count"] == 1
    # Cluster-scoped objects get their Events in "default".
    await rec.write(ObjectRef("v1", "Node", "node-1"), NORMAL, "Reclaiming", "drain")
    assert {e["involvedObject"]["kind"] for e in kube.store.objects("events", "default")} == {"CapacityRequest", "Node"}
    assert m.events.labels(reason="Shortfall", outcome="updated")._value.get() == 2


def frame(v: shard_pb2.NeedVerdict, at_ns: int = 1_700_000_000 * 10**9) -> shard_pb2.NeedVerdicts:
    return shard_pb2.NeedVerdicts(cluster_id="c1", cycle=9, computed_at_unix_nanos=at_ns, verdicts=[v])


def test_conditions_from_a_verdict_and_their_events() -> None:
    short = shard_pb2.NeedVerdict(fingerprint="fp", satisfied=False,
                                  unmet_reason=shardread_pb2.UNMET_REASON_NO_MATCHING_SUPPLY, machines_missing=3,
                                  shortfall_age_cycles=2, shortfall_age_seconds=20,
                                  deficit={"resources": {"cpu": "24"}},  # type: ignore[arg-type]
                                  matching_supply=shardread_pb2.MatchingSupply())
    p = plan_status(short, frame(short), 4, {"phase": "Acknowledged"}, "NOW")
    assert p.status is not None
    conds = {c["type"]: c for c in p.status["conditions"]}
    assert conds["Satisfied"]["status"] == "False" and conds["Satisfied"]["reason"] == "NoMatchingSupply"
    assert conds["Unsatisfied"]["status"] == "True" and conds["Unsatisfied"]["reason"] == "NoMatchingSupply"
    assert "no machine of a fitting shape" in conds["Satisfied"]["message"] and "cpu=24" in conds["Satisfied"]["message"]
    assert conds["Escalated"]["status"] == "False"
    assert all(c["observedGeneration"] == 4 and c["lastTransitionTime"] == "NOW" for c in conds.values())
    assert p.status["machines"] == {"bound": 0, "coming": 0, "missing": 3}
    assert p.status["shortfall"]["since"] == "2023-11-14T22:13:00Z"  # 20 s before the cycle ran
    assert p.status["observedGeneration"] == 4 and p.status["needFingerprint"] == "fp"
    assert [e[1] for e in p.events] == ["Shortfall"]
    # The same verdict again: nothing to write, no Event.
    cur = {"phase": "Acknowledged", **p.status}
    assert plan_status(short, frame(short), 4, cur, "LATER") == type(p)(None, ())
    # Escalated: only the Escalated condition flips (and its Event); Satisfied keeps its transition time.
    esc = shard_pb2.NeedVerdict()
    esc.CopyFrom(short)
    esc.escalated, esc.shortfall_age_cycles = True, 6
    p2 = plan_status(esc, frame(esc), 4, cur, "LATER")
    assert p2.status is not None and [e[1] for e in p2.events] == ["Escalated"]
    c2 = {c["type"]: c for c in p2.status["conditions"]}
    assert c2["Escalated"]["status"] == "True" and c2["Escalated"]["lastTransitionTime"] == "LATER"
    assert c2["Satisfied"]["lastTransitionTime"] == "NOW"
    assert p2.status["shortfall"]["since"] == "2023-11-14T22:13:00Z"
    cur2 = {**cur, **p2.status}
    # Machines start coming, then it is met: Provisioning, then the shortfall is cleared.
    coming = shard_pb2.NeedVerdict(fingerprint="fp", satisfied=True, machines_coming=2, machines_bound=1)
    p3 = plan_status(coming, frame(coming), 5, cur2, "LATER2")
    assert p3.status is not None and [e[1] for e in p3.events] == ["Provisioning"]
    assert p3.status["shortfall"] is None and p3.status["machines"] == {"bound": 1, "coming": 2, "missing": 0}
    c3 = {c["type"]: c for c in p3.status["conditions"]}
    assert c3["Satisfied"]["status"] == "True" and c3["Satisfied"]["reason"] == "Satisfied"
    assert c3["Unsatisfied"]["status"] == "False" and c3["Satisfied"]["observedGeneration"] == 5


def test_operator_and_shard_agree_on_need_fingerprints() -> None:
    crs = [
        {**cr("a", {"cpu": "1"}, priority=10), "metadata": {"name": "a", "namespace": "n1", "resourceVersion": "1"}},
        {**cr("b", {"cpu": "3", "memory": "1Gi"}, priority=10), "metadata": {"name": "b", "namespace": "n2"}},
        cr("c", {"cpu": "1"}, priority=10, requirements=[
            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z2", "z1", "z1"]},
            {"key": "node.kubernetes.io/instance-type", "operator": "Exists"}],
           interruptionPenalty="40", reclamationPenalty="3",
           topologySpread=[{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                            "whenUnsatisfiable": "DoNotSchedule"}]),
        cr("d", {"nvidia.com/gpu": "1"}, priority=5,
           coLocation={"topologyKey": "topology.kubernetes.io/zone", "labelSelector": {"matchLabels": {"j": "x"}}}),
    ]
    r = build_rollup("c1", crs, 1, disruption_budgets=("10%/10m",))
    _, needs = rollup_from_proto(r.message, 1)  # what the shard holds after taking the roll-up
    shard_fps = {n.fingerprint for n in needs}
    assert len(shard_fps) == 3
    assert set(r.fingerprints.values()) == shard_fps
    assert r.fingerprints[("n1", "a")] == r.fingerprints[("n2", "b")]  # folded into one need
    assert len({r.fingerprints[k] for k in (("n1", "a"), ("default", "c"), ("default", "d"))}) == 3
    # the budget rides on the roll-up and a change of it is a change of the demand
    assert list(r.message.disruption_budgets) == ["10%/10m"]
    r2 = build_rollup("c1", crs, 2, disruption_budgets=("5%/10m",))
    assert demand_fingerprint(r.message) != demand_fingerprint(r2.message)
    assert demand_fingerprint(r.message) == demand_fingerprint(build_rollup("c1", crs, 3, disruption_budgets=("10%/10m",)).message)


def test_node_registration_pure_parts() -> None:
    idx = NodeIndex()
    assert idx.phase("n1") == "Joining"
    idx.apply("ADDED", {"metadata": {"name": "n1"}, "spec": {"providerID": "fake://h1"}, "status": {}})
    assert idx.phase("n1") == "Registered" and idx.phase("other-name", "fake://h1") == "Registered"
    ready = {"metadata": {"name": "n1"}, "spec": {"providerID": "fake://h1"},
             "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    assert node_ready(ready)
    idx.apply("MODIFIED", ready)
    assert idx.phase("n1") == "Ready"
    idx.apply("DELETED", ready)
    assert idx.phase("n1") == "Joining" and not idx.by_provider_id
    ups = [{"metadata": {"name": "un-m1"}, "status": {"phase": "Joining", "machineID": "m1",
                                                      "configuredTime": "2024-01-01T00:00:00Z",
                                                      "nodeRef": {"name": "n1"}}},
           {"metadata": {"name": "un-m2"}, "status": {"phase": "Ready", "machineID": "m2",
                                                      "configuredTime": "2024-01-01T00:00:00Z"}}]
    t0 = 1704067200.0
    assert due_timeouts(ups, idx, 900, t0 + 899) == []
    due = due_timeouts(ups, idx, 900, t0 + 901)
    assert [(d.machine_id, d.node_name, d.waited_seconds) for d in due] == [("m1", "n1", 901)]
    idx.apply("ADDED", ready)
    assert due_timeouts(ups, idx, 900, t0 + 901) == []
    assert parse_duration("15m") == 900 and parse_duration("90") == 90 and parse_duration("1.5h") == 5400


def test_registered_but_never_ready_times_out() -> None:
    """A Node that joined but stays NotReady is reported once the ready timeout passed; a Ready Node,
    a vanished Node, or a ready timeout of 0 is not."""
    idx = NodeIndex()
    not_ready = {"metadata": {"name": "n1"}, "spec": {"providerID": "fake://h1"},
                 "status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    idx.apply("ADDED", not_ready)
    ups = [{"metadata": {"name": "un-m1"}, "status": {"phase": "Registered", "machineID": "m1",
                                                      "configuredTime": "2024-01-01T00:00:00Z",
                                                      "providerID": "fake://h1"}}]
    t0 = 1704067200.0
    assert due_timeouts(ups, idx, 900, t0 + 5000) == []  # no ready timeout: never
    assert due_timeouts(ups, idx, 900, t0 + 1799, ready_timeout=1800) == []
    due = due_timeouts(ups, idx, 900, t0 + 1801, ready_timeout=1800)
    assert [(d.machine_id, d.node_name, d.waited_seconds, d.registered) for d in due] == [("m1", "n1", 1801, True)]
    idx.apply("MODIFIED", {**not_ready, "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert due_timeouts(ups, idx, 900, t0 + 1801, ready_timeout=1800) == []
    idx.apply("DELETED", not_ready)
    assert due_timeouts(ups, idx, 900, t0 + 1801, ready_timeout=1800) == []


def test_a_need_held_by_a_paused_shard_shows_actuation_paused() -> None:
    paused = shard_pb2.NeedVerdict(fingerprint="fp", satisfied=False, actuation_paused=True, machines_bound=3,
                                   machines_missing=2, matching_supply=shardread_pb2.MatchingSupply(idle=4))
    p = plan_status(paused, frame(paused), 2, {"phase": "Acknowledged"}, "NOW")
    assert p.status is not None
    conds = {c["type"]: c for c in p.status["conditions"]}
    assert conds["Satisfied"]["status"] == "False" and conds["Satisfied"]["reason"] == "ActuationPaused"
    assert "paused" in conds["Satisfied"]["message"] and "resumed" in conds["Satisfied"]["message"]
    assert p.status["machines"] == {"bound": 3, "coming": 0, "missing": 2}
