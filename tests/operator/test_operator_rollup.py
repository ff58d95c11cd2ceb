"""Roll-up construction (pure): aggregation key, sums and maxes, buckets, co-location, canonical order."""

from __future__ import annotations

from typing import Any

from conftest import cr

from bigfleet.operator.rollup import build_rollup, demand_fingerprint
from bigfleet.v1alpha1 import capacity_pb2

R = capacity_pb2.NodeSelectorRequirement


def _needs(crs: list[dict[str, Any]]) -> list[capacity_pb2.CapacityNeed]:
    return list(build_rollup("c1", crs, 42).message.needs)


def test_same_profile_aggregates_sum_and_max() -> None:
    reqs = [{"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["m6i.large"]}]
    out = build_rollup("c1", [
        cr("a", {"cpu": "500m", "memory": "1Gi"}, requirements=reqs),
        cr("b", {"cpu": "2", "memory": "512Mi"}, requirements=reqs),
    ], 42)
    assert out.message.cluster_id == "c1" and out.message.timestamp_unix_nanos == 42
    assert len(out.message.needs) == 1
    n = out.message.needs[0]
    assert dict(n.aggregate_resources) == {"cpu": "2500m", "memory": "1536Mi"}
    assert dict(n.min_unit) == {"cpu": "2", "memory": "1Gi"}
    assert n.priority == 100
    assert [(r.key, r.operator, list(r.values)) for r in n.requirements] == [
        ("node.kubernetes.io/instance-type", R.OPERATOR_IN, ["m6i.large"])]
    assert n.interruption_penalty_bucket == capacity_pb2.PENALTY_BUCKET_UNSPECIFIED
    assert out.to_acknowledge == (("default", "a"), ("default", "b"))


def test_key_fields_split_needs_and_order_is_canonical() -> None:
    crs = [
        cr("low", {"cpu": "1"}, priority=10),
        cr("high", {"cpu": "1"}, priority=1000),
        cr("pen", {"cpu": "1"}, priority=10, interruptionPenalty="0.5", reclamationPenalty="3"),
        cr("spread", {"cpu": "1"}, priority=10, topologySpread=[
            {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]),
        cr("anyway", {"cpu": "1"}, priority=10, topologySpread=[
            {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}]),
    ]
    needs = _needs(crs)
    assert needs[0].priority == 1000
    assert len(needs) == 4  # ScheduleAnyway is dropped, so "anyway" folds into "low"
    pen = [n for n in needs if n.interruption_penalty_bucket != capacity_pb2.PENALTY_BUCKET_UNSPECIFIED]
    assert len(pen) == 1
    assert pen[0].interruption_penalty_bucket == capacity_pb2.PENALTY_BUCKET_HALF_DOLLAR
    assert pen[0].reclamation_penalty_bucket == capacity_pb2.PENALTY_BUCKET_4
    plain = [n for n in needs if n.priority == 10 and not n.spread and not n.interruption_penalty_bucket]
    assert dict(plain[0].aggregate_resources) == {"cpu": "2"}
    # Input order does not matter: the same demand gives byte-identical roll-ups.
    a = build_rollup("c1", crs, 1).message
    b = build_rollup("c1", list(reversed(crs)), 1).message
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)
    assert demand_fingerprint(a) == demand_fingerprint(build_rollup("c1", crs, 999).message)


def test_requirement_value_order_does_not_split() -> None:
    r1 = [{"key": "zone", "operator": "In", "values": ["b", "a"]}, {"key": "gpu", "operator": "Exists"}]
    r2 = [{"key": "gpu", "operator": "Exists"}, {"key": "zone", "operator": "In", "values": ["a", "b", "a"]}]
    needs = _needs([cr("x", {"cpu": "1"}, requirements=r1), cr("y", {"cpu": "1"}, requirements=r2)])
    assert len(needs) == 1
    assert [(r.key, list(r.values)) for r in needs[0].requirements] == [("gpu", []), ("zone", ["a", "b"])]


def test_colocation_becomes_same_and_groups_never_merge() -> None:
    gang1 = {"topologyKey": "rack", "labelSelector": {"matchLabels": {"gang": "g1", "app": "t"}}}
    gang1b = {"topologyKey": "rack", "labelSelector": {"matchLabels": {"app": "t", "gang": "g1"}}}
    gang2 = {"topologyKey": "rack", "labelSelector": {"matchLabels": {"gang": "g2"}}}
    needs = _needs([
        cr("a", {"cpu": "1"}, coLocation=gang1),
        cr("b", {"cpu": "1"}, coLocation=gang1b),
        cr("c", {"cpu": "1"}, coLocation=gang2),
        cr("d", {"cpu": "1"}),
    ])
    assert len(needs) == 3
    grouped = {n.group: n for n in needs}
    g1 = "rack\x00app=t,gang=g1,;"
    assert set(grouped) == {g1, "rack\x00gang=g2,;", ""}
    assert dict(grouped[g1].aggregate_resources) == {"cpu": "2"}
    assert [(r.key, r.operator) for r in grouped[g1].requirements] == [("rack", R.OPERATOR_SAME)]
    assert not grouped[""].requirements


def test_invalid_crs_are_skipped_not_fatal() -> None:
    out = build_rollup("c1", [
        cr("ok", {"cpu": "1"}),
        cr("gt", {"cpu": "1"}, requirements=[{"key": "n", "operator": "Gt", "values": ["3"]}]),
        cr("badq", {"cpu": "lots"}),
        cr("neg", {"cpu": "1"}, interruptionPenalty="-1"),
        {"apiVersion": "bigfleet.lucy.sh/v1alpha1", "kind": "CapacityRequest",
         "metadata": {"name": "nospec", "namespace": "default"}},
    ], 1)
    assert out.crs_included == 1
    assert sorted(s.name for s in out.skipped) == ["badq", "gt", "neg", "nospec"]
    assert len(out.message.needs) == 1


def test_acknowledged_crs_are_not_acked_again_and_deleting_ones_are_withdrawn() -> None:
    a = cr("a", {"cpu": "1"})
    a["status"] = {"phase": "Acknowledged"}
    b = cr("b", {"cpu": "1"})
    b["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    out = build_rollup("c1", [a, b], 1)
    assert out.to_acknowledge == ()
    assert dict(out.message.needs[0].aggregate_resources) == {"cpu": "1"}


def test_empty_demand_is_an_empty_rollup() -> None:
    out = build_rollup("c1", [], 7)
    assert out.message.cluster_id == "c1" and not out.message.needs


def test_memo_reuses_unchanged_crs_and_remaps_changed_ones() -> None:
    from bigfleet.operator.rollup import MapCache

    a = cr("a", {"cpu": "1"})
    b = cr("b", {"cpu": "2"})
    a["metadata"]["resourceVersion"], b["metadata"]["resourceVersion"] = "1", "1"
    cache = MapCache()
    first = build_rollup("c1", [a, b], 1, cache)
    assert cache.hits == 0 and len(cache.entries) == 2
    b2 = cr("b", {"cpu": "5"})
    b2["metadata"]["resourceVersion"] = "2"
    second = build_rollup("c1", [a, b2], 1, cache)
    assert cache.hits == 1
    assert dict(second.message.needs[0].aggregate_resources) == {"cpu": "6"}
    assert second.message == build_rollup("c1", [a, b2], 1).message  # memo never changes the answer
    assert dict(first.message.needs[0].aggregate_resources) == {"cpu": "3"}
    build_rollup("c1", [a], 1, cache)
    assert set(cache.entries) == {("default", "a")}  # entries of vanished CRs are dropped


def test_token_bucket_allows_burst_then_paces() -> None:
    from bigfleet.operator.kube import TokenBucket

    b = TokenBucket(rate=10, burst=3, now=0.0)
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert abs(b.take(0.0) - 0.1) < 1e-9  # fourth request waits one token interval
    assert abs(b.take(0.0) - 0.2) < 1e-9
    b2 = TokenBucket(rate=10, burst=3, now=0.0)
    for _ in range(3):
        b2.take(0.0)
    assert b2.take(10.0) == 0.0  # refilled (capped at burst) after idling


def _props() -> object:
    from hypothesis import strategies as st

    req = st.sampled_from([[], [{"key": "zone", "operator": "In", "values": ["a"]}],
                           [{"key": "gpu", "operator": "Exists"}]])
    one = st.fixed_dictionaries({
        "cpu": st.integers(1, 64_000), "mem": st.integers(0, 1 << 20), "prio": st.sampled_from([0, 10, 1000]),
        "req": req, "pen": st.sampled_from([None, "0", "0.3", "7", "1e7"]),
        "gang": st.sampled_from([None, "g1", "g2"]),
    })
    return st.lists(one, max_size=40)


def test_rollup_conserves_demand_and_is_order_free() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from bigfleet.needs import parse_quantity

    @settings(max_examples=150, deadline=None)
    @given(_props(), st.randoms())
    def check(items: list[dict[str, Any]], rnd: Any) -> None:
        crs = []
        for i, it in enumerate(items):
            spec: dict[str, Any] = {"requirements": it["req"]}
            if it["pen"] is not None:
                spec["interruptionPenalty"] = it["pen"]
            if it["gang"]:
                spec["coLocation"] = {"topologyKey": "rack", "labelSelector": {"matchLabels": {"gang": it["gang"]}}}
            res = {"cpu": f"{it['cpu']}m", **({"memory": f"{it['mem']}Ki"} if it["mem"] else {})}
            crs.append(cr(f"c{i}", res, priority=it["prio"], **spec))
        out = build_rollup("c1", crs, 1)
        assert out.crs_included == len(crs) and not out.skipped
        for resource, unit in (("cpu", 1), ("memory", 1024 * 1000)):
            want = sum((it["cpu"] if resource == "cpu" else it["mem"] * unit) for it in items)
            got = sum(parse_quantity(n.aggregate_resources.get(resource, "0")) for n in out.message.needs)
            assert got == want
        for n in out.message.needs:
            for k, v in n.min_unit.items():
                assert parse_quantity(v) <= parse_quantity(n.aggregate_resources[k])
            assert bool(n.group) == any(r.operator == R.OPERATOR_SAME for r in n.requirements)
        shuffled = list(crs)
        rnd.shuffle(shuffled)
        assert build_rollup("c1", shuffled, 1).message == out.message

    check()
