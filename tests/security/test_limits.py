"""Input limits and the per-session throttle (pure, deterministic time)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigfleet.security.limits import (
    DEFAULT_LIMITS,
    LimitExceeded,
    Limits,
    SessionThrottle,
    ThrottleConfig,
    TokenBucket,
    Verdict,
    check_bootstrap_blob,
    check_bootstrap_response,
    check_frame_size,
    check_metadata,
    check_rollup,
)
from bigfleet.v1alpha1 import capacity_pb2 as cap
from bigfleet.v1alpha1 import shard_pb2 as spb

SMALL = Limits(
    max_needs_per_rollup=3,
    max_requirements_per_need=2,
    max_values_per_requirement=2,
    max_resources_per_need=2,
    max_bootstrap_blob_bytes=10,
    max_metadata_entries=2,
    max_metadata_bytes=20,
)


def need(**kw: object) -> cap.CapacityNeed:
    return cap.CapacityNeed(**kw)  # type: ignore[arg-type]


def req(key: str = "zone", *values: str) -> cap.NodeSelectorRequirement:
    return cap.NodeSelectorRequirement(key=key, operator=cap.NodeSelectorRequirement.OPERATOR_IN, values=list(values))


def test_rollup_within_limits_passes() -> None:
    r = cap.ClusterCapacityNeeds(
        cluster_id="c",
        needs=[need(requirements=[req("zone", "a", "b")], aggregate_resources={"cpu": "4", "memory": "8Gi"})],
    )
    check_rollup(r, SMALL)
    check_rollup(r)


@pytest.mark.parametrize(
    ("rollup", "field"),
    [
        (cap.ClusterCapacityNeeds(cluster_id="c", needs=[need()] * 4), "needs"),
        (cap.ClusterCapacityNeeds(cluster_id="c" * 300), "cluster_id"),
        (cap.ClusterCapacityNeeds(needs=[need(requirements=[req(), req(), req()])]), "needs[0].requirements"),
        (cap.ClusterCapacityNeeds(needs=[need(requirements=[req("k", "a", "b", "c")])]), "needs[0].requirements[0].values"),
        (cap.ClusterCapacityNeeds(needs=[need(requirements=[req("k" * 400, "a")])]), "needs[0].requirements[0].key"),
        (cap.ClusterCapacityNeeds(needs=[need(requirements=[req("k", "v" * 64)])]), "needs[0].requirements[0].values[0]"),
        (cap.ClusterCapacityNeeds(needs=[need(aggregate_resources={"a": "1", "b": "1", "c": "1"})]), "needs[0].aggregate_resources"),
        (cap.ClusterCapacityNeeds(needs=[need(min_unit={"cpu": "1" * 100})]), "needs[0].min_unit['cpu']"),
        (cap.ClusterCapacityNeeds(needs=[need(group="g" * 4097)]), "needs[0].group"),
        (
            cap.ClusterCapacityNeeds(needs=[need(spread=[cap.TopologySpread(topology_key="t")] * 17)]),
            "needs[0].spread",
        ),
    ],
)
def test_rollup_over_a_limit_names_the_field(rollup: cap.ClusterCapacityNeeds, field: str) -> None:
    with pytest.raises(LimitExceeded) as ei:
        check_rollup(rollup, SMALL)
    assert ei.value.field == field


def test_bootstrap_blob_and_metadata() -> None:
    check_bootstrap_response(spb.BootstrapBlobResponse(request_id="r", user_data=b"x" * 10), SMALL)
    with pytest.raises(LimitExceeded, match="user_data"):
        check_bootstrap_response(spb.BootstrapBlobResponse(request_id="r", user_data=b"x" * 11), SMALL)
    with pytest.raises(LimitExceeded, match="request_id"):
        check_bootstrap_response(spb.BootstrapBlobResponse(request_id="r" * 65))
    with pytest.raises(LimitExceeded, match="bootstrap_blob"):
        check_bootstrap_blob(b"x" * (DEFAULT_LIMITS.max_bootstrap_blob_bytes + 1))
    check_metadata(None)
    check_metadata([("a", "b"), ("c", b"d")], SMALL)
    with pytest.raises(LimitExceeded, match="entries"):
        check_metadata([("a", "b")] * 3, SMALL)
    with pytest.raises(LimitExceeded, match="bytes"):
        check_metadata([("a", "b" * 30)], SMALL)
    with pytest.raises(LimitExceeded):
        check_frame_size(DEFAULT_LIMITS.max_frame_bytes + 1)


def test_token_bucket_refills_and_caps() -> None:
    b = TokenBucket(rate=2.0, burst=3.0)
    assert [b.try_take(0.0) for _ in range(4)] == [True, True, True, False]
    assert b.wait_time(0.0) == pytest.approx(0.5)
    assert b.try_take(0.5)
    assert not b.try_take(0.5)
    assert b.try_take(100.0) and b.tokens == pytest.approx(2.0)  # capped at burst, minus one


def test_token_bucket_ignores_a_clock_that_steps_back() -> None:
    b = TokenBucket(rate=1.0, burst=1.0)
    assert b.try_take(10.0)
    assert not b.try_take(5.0)
    assert not b.try_take(10.5)
    assert b.try_take(11.0)


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-1, 1), (float("nan"), 1), (1, 0.5), (1, float("inf"))])
def test_token_bucket_rejects_bad_config(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, burst)


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(0.1, 1000),
    burst=st.floats(1, 1000),
    steps=st.lists(st.tuples(st.floats(-5, 50), st.floats(0.1, 5)), max_size=60),
)
def test_token_bucket_never_admits_more_than_rate_allows(
    rate: float, burst: float, steps: list[tuple[float, float]]
) -> None:
    """Over any (even non-monotonic) timeline, admitted cost <= burst + rate × elapsed forward time."""
    b = TokenBucket(rate, burst)
    admitted = 0.0
    first: float | None = None
    high = None
    for now, cost in steps:
        first = now if first is None else first
        high = now if high is None else max(high, now)
        if b.try_take(now, cost):
            admitted += cost
        assert 0 <= b.tokens <= burst + 1e-9
    if first is not None and high is not None:
        assert admitted <= burst + rate * max(0.0, high - first) + 1e-6


def test_session_throttle_defers_rollup_floods_then_closes_abuse() -> None:
    t = SessionThrottle(ThrottleConfig(rollups_per_second=1, rollup_burst=2, hard_frames_per_second=10, hard_frame_burst=5))
    verdicts = []
    for _ in range(4):
        assert t.on_frame(0.0) is Verdict.ACCEPT
        verdicts.append(t.on_rollup(0.0))
    assert verdicts == [Verdict.ACCEPT, Verdict.ACCEPT, Verdict.DEFER, Verdict.DEFER]
    assert t.deferred == 2 and t.rollup_delay(0.0) == pytest.approx(1.0)
    assert t.on_frame(0.0) is Verdict.ACCEPT  # 5th frame: the hard burst is spent
    assert t.on_frame(0.0) is Verdict.CLOSE
    assert t.on_frame(100.0) is Verdict.CLOSE  # closed stays closed


def test_independent_sessions_do_not_share_budgets() -> None:
    cfg = ThrottleConfig(rollups_per_second=1, rollup_burst=1, hard_frames_per_second=1, hard_frame_burst=1)
    noisy, quiet = SessionThrottle(cfg), SessionThrottle(cfg)
    noisy.on_frame(0.0)
    assert noisy.on_frame(0.0) is Verdict.CLOSE
    assert quiet.on_frame(0.0) is Verdict.ACCEPT and quiet.on_rollup(0.0) is Verdict.ACCEPT


def test_operator_frame_checks() -> None:
    from bigfleet.security.limits import check_operator_frame

    check_operator_frame(spb.OperatorMessage(hello=spb.Hello(cluster_id="c", protocol_version="v1alpha1")))
    check_operator_frame(spb.OperatorMessage(rollup=cap.ClusterCapacityNeeds(cluster_id="x" * 999)))  # left to the decoder
    check_operator_frame(spb.OperatorMessage())
    with pytest.raises(LimitExceeded, match=r"hello\.cluster_id"):
        check_operator_frame(spb.OperatorMessage(hello=spb.Hello(cluster_id="c" * 254)))
    with pytest.raises(LimitExceeded, match="user_data"):
        check_operator_frame(spb.OperatorMessage(bootstrap_response=spb.BootstrapBlobResponse(user_data=b"x" * 11)), SMALL)
    with pytest.raises(LimitExceeded, match=r"instruction_id"):
        check_operator_frame(spb.OperatorMessage(reclaim_ack=spb.ReclaimAck(instruction_id="i" * 65)))


def test_colocation_group_is_held_to_253_characters_at_ingest() -> None:
    """docs/security.md: "cluster / shard id, co-location group: 253 characters" (was 4 096)."""
    from bigfleet.needs import ValidationError
    from bigfleet.wire.needs import MAX_COLOCATION_GROUP_LEN, rollup_from_proto, validate_group

    assert DEFAULT_LIMITS.max_group_len == MAX_COLOCATION_GROUP_LEN == 253
    at_limit = "topology.kubernetes.io/rack\x00" + "a" * (253 - 28)
    assert len(at_limit) == 253
    check_rollup(cap.ClusterCapacityNeeds(cluster_id="c", needs=[need(), need(group=at_limit)]))
    assert validate_group(at_limit) == at_limit
    with pytest.raises(LimitExceeded) as ei:
        check_rollup(cap.ClusterCapacityNeeds(cluster_id="c", needs=[need(), need(group=at_limit + "b")]))
    assert ei.value.field == "needs[1].group"
    assert str(ei.value) == "needs[1].group: 254 characters, limit 253"
    with pytest.raises(ValidationError) as ve:
        validate_group(at_limit + "b", "spec.coLocation")
    assert ve.value.field == "spec.coLocation" and "limit 253" in str(ve.value)
    # What a shard replicated under the old bound still decodes on a new leader (restore path).
    pb = cap.ClusterCapacityNeeds(cluster_id="c", needs=[need(aggregate_resources={"cpu": "1"}, group="g" * 4096)])
    _, needs = rollup_from_proto(pb, 1)
    assert needs[0].profile.group == "g" * 4096
