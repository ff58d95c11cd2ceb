"""Property-based fuzzing of the decoders: succeed, or raise the module's typed error — nothing else.

Each test also checks a round trip or cross-module agreement where one is defined, so a
decoder that silently mangles input fails here too.
"""

from __future__ import annotations

import string
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bigfleet.security.limits import LimitExceeded, check_rollup
from bigfleet.tools import fuzz
from bigfleet.v1alpha1 import capacity_pb2 as cap

from .known_open import is_known_open

needs = pytest.importorskip("bigfleet.needs")
wire_needs = pytest.importorskip("bigfleet.wire.needs")

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- generic: raw bytes through every harness ---------------------------------------------------


@pytest.mark.parametrize("name", sorted(fuzz.TARGETS))
@FAST
@given(data=st.binary(max_size=512))
def test_every_harness_on_random_bytes(name: str, data: bytes) -> None:
    harness, why = fuzz.load(name)
    if harness is None:
        pytest.skip(why)
    exc = fuzz.run_one(harness, data)
    assert exc is None or is_known_open(name, exc), f"{type(exc).__name__}: {exc}"


# --- quantities ---------------------------------------------------------------------------------

quantity_like = st.from_regex(r"\A[+-]?[0-9]{0,22}(\.[0-9]{0,12})?([eE][+-]?[0-9]{1,4}|[kMGTPE]i?|[mnu])?\Z")


@FAST
@given(text=st.one_of(st.text(max_size=70), quantity_like))
def test_parse_quantity_total_and_canonical(text: str) -> None:
    try:
        milli = needs.parse_quantity(text, "q")
    except needs.ValidationError:
        return
    assert needs.parse_quantity(needs.format_quantity(milli), "q") == milli


# --- roll-ups -----------------------------------------------------------------------------------

label = st.text(string.ascii_lowercase + string.digits + "-./", min_size=1, max_size=30)
value = st.text(string.ascii_lowercase + string.digits + "-_.", min_size=1, max_size=20)
qty = st.sampled_from(["1", "2", "500m", "8Gi", "96", "1.5", "0"]) | st.text(max_size=8)
requirement = st.builds(
    cap.NodeSelectorRequirement,
    key=label | st.text(max_size=5),
    operator=st.integers(0, 6),
    values=st.lists(value | st.text(max_size=3), max_size=3),
)
need = st.builds(
    cap.CapacityNeed,
    requirements=st.lists(requirement, max_size=4),
    aggregate_resources=st.dictionaries(st.sampled_from(["cpu", "memory", "nvidia.com/gpu"]) | label, qty, max_size=3),
    priority=st.integers(-(2**31), 2**31 - 1),
    interruption_penalty_bucket=st.integers(0, 28),
    reclamation_penalty_bucket=st.integers(0, 28),
    min_unit=st.dictionaries(st.sampled_from(["cpu", "memory"]), qty, max_size=2),
    group=st.text(max_size=6),
)
rollup = st.builds(cap.ClusterCapacityNeeds, cluster_id=st.sampled_from(["cluster-a", "", "a b"]) | label,
                   timestamp_unix_nanos=st.integers(0, 2**63 - 1), needs=st.lists(need, max_size=5))


@FAST
@given(pb=rollup)
def test_rollup_decoder_total_and_round_trips(pb: cap.ClusterCapacityNeeds) -> None:
    try:
        cluster_id, decoded = wire_needs.rollup_from_proto(pb, 7)
    except needs.ValidationError as exc:
        assert exc.field is not None
        return
    # The limits pre-check must never refuse what the decoder accepts.
    check_rollup(pb)
    again = wire_needs.rollup_to_proto(cluster_id, decoded)
    cluster2, decoded2 = wire_needs.rollup_from_proto(again, 7)
    assert cluster2 == cluster_id
    assert [n.profile for n in decoded2] == [n.profile for n in decoded]
    assert [n.aggregate_resources for n in decoded2] == [n.aggregate_resources for n in decoded]
    table = needs.NeedsTable()
    table.replace(cluster_id, decoded, 7)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pb=rollup)
def test_limits_check_total(pb: cap.ClusterCapacityNeeds) -> None:
    try:
        check_rollup(pb)
    except LimitExceeded as exc:
        assert exc.field


def test_rollup_over_need_count_rejected_by_both_layers() -> None:
    pb = cap.ClusterCapacityNeeds(cluster_id="c", needs=[cap.CapacityNeed()] * 100_001)
    with pytest.raises(LimitExceeded, match="needs"):
        check_rollup(pb)
    with pytest.raises(needs.ValidationError):
        wire_needs.rollup_from_proto(pb, 1)


# --- machines -----------------------------------------------------------------------------------


@FAST
@given(
    state=st.integers(0, 10),
    ct=st.integers(0, 6),
    price=st.floats(allow_nan=True, allow_infinity=True),
    prob=st.floats(allow_nan=True, allow_infinity=True),
    res=st.dictionaries(st.sampled_from(["cpu", "memory"]) | st.text(max_size=4), qty, max_size=3),
    labels=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    md=st.dictionaries(st.sampled_from(["bigfleet.lucy.sh/assigned-priority", "bigfleet.lucy.sh/assigned-group",
                                        "bigfleet.lucy.sh/assigned-interruption-penalty-dollars"]) | st.text(max_size=5),
                       st.text(max_size=12), max_size=3),
    cluster=st.sampled_from(["", "cluster-a"]),
)
def test_machine_decoder_total_and_round_trips(
    state: int, ct: int, price: float, prob: float, res: dict[str, str], labels: dict[str, str],
    md: dict[str, str], cluster: str,
) -> None:
    wire = pytest.importorskip("bigfleet.wire.machine")
    from bigfleet.v1alpha1 import provider_pb2

    pb: Any = provider_pb2.Machine(id="m-1", instance_type="t", zone="z", price_per_hour=price,
                                   interruption_probability=prob, labels=labels, shard_metadata=md, cluster=cluster)
    pb.state = state
    pb.capacity_type = ct
    pb.resources.resources.update(res)
    try:
        m = wire.machine_from_proto(pb, now_unix_nanos=5)
    except needs.ValidationError:
        return
    assert wire.machine_from_proto(wire.machine_to_proto(m), now_unix_nanos=5) == m


# --- CapacityRequest → roll-up (operator) → shard --------------------------------------------------

k8s_name = st.from_regex(r"\A[a-z0-9]([a-z0-9.-]{0,20}[a-z0-9])?(/[a-z0-9]([a-z0-9_.-]{0,10}[a-z0-9])?)?\Z")
k8s_value = st.from_regex(r"\A[a-z0-9]([a-z0-9_.-]{0,20}[a-z0-9])?\Z")
cr_spec = st.fixed_dictionaries(
    {
        "priority": st.integers(-(2**31), 2**31 - 1),
        "resources": st.dictionaries(st.sampled_from(["cpu", "memory", "nvidia.com/gpu"]),
                                     st.sampled_from(["1", "250m", "4Gi", "8"]), min_size=1, max_size=3),
    },
    optional={
        "requirements": st.lists(
            st.fixed_dictionaries({"key": k8s_name, "operator": st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist"]),
                                   "values": st.lists(k8s_value, min_size=1, max_size=3)}),
            max_size=3,
        ),
        "interruptionPenalty": st.sampled_from(["0", "1", "100", "1e9", "0.25"]),
        "reclamationPenalty": st.sampled_from(["0", "5", "1Mi"]),
        "topologySpread": st.lists(st.fixed_dictionaries({"maxSkew": st.integers(1, 5), "topologyKey": k8s_name,
                                                          "whenUnsatisfiable": st.sampled_from(["DoNotSchedule", "ScheduleAnyway"])}),
                                   max_size=2),
        # coLocation is left out: see test_regressions.py (operator puts NUL into CapacityNeed.group).
    },
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(cr_spec, max_size=6))
def test_well_formed_crs_give_a_roll_up_the_shard_accepts(specs: list[dict[str, Any]]) -> None:
    """Kubernetes-valid CapacityRequests: the operator and the shard must agree on every one."""
    rollup_mod = pytest.importorskip("bigfleet.operator.rollup")
    crs = [{"metadata": {"name": f"cr-{i}", "namespace": "default"}, "spec": s} for i, s in enumerate(specs)]
    r = rollup_mod.build_rollup("cluster-a", crs, 11)
    check_rollup(r.message)
    cluster_id, decoded = wire_needs.rollup_from_proto(r.message, 11)
    assert cluster_id == "cluster-a"
    assert r.crs_included + len(r.skipped) == len(specs)
    assert len(decoded) <= r.crs_included


# --- identities ---------------------------------------------------------------------------------


@FAST
@given(text=st.text(max_size=40) | st.builds(lambda r, i: f"bigfleet://{r}/{i}",
                                            st.sampled_from(["cluster", "shard", "admin", "readonly", "x"]),
                                            st.text(max_size=12)))
def test_identity_parse_total(text: str) -> None:
    from bigfleet.security.identity import Identity, IdentityError

    try:
        ident = Identity.parse(text)
    except IdentityError:
        return
    assert Identity.parse(ident.uri) == ident and ident.uri == text
