# mypy: disable-error-code="arg-type,no-untyped-call,unused-ignore"
"""The parse/profile caches are invisible: same answers, and errors are never remembered."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigfleet.needs import NeedsTable, Resources, ValidationError, parse_quantity
from bigfleet.needs import quantity as quantity_mod
from bigfleet.needs import resources as resources_mod
from bigfleet.v1alpha1 import capacity_pb2
from bigfleet.wire import needs as wire_mod
from bigfleet.wire.needs import rollup_from_proto

from .strategies import needs_for


def test_errors_are_not_cached() -> None:
    for _ in range(2):
        with pytest.raises(ValidationError):
            parse_quantity("12xyz")
        with pytest.raises(ValidationError):
            Resources.parse({"cpu": "-1"})
    bad = capacity_pb2.ClusterCapacityNeeds(
        cluster_id="c",
        needs=[capacity_pb2.CapacityNeed(requirements=[capacity_pb2.NodeSelectorRequirement(key="k", operator=9)])],
    )
    for _ in range(2):
        with pytest.raises(ValidationError):
            rollup_from_proto(bad, 1)


def test_results_survive_cache_clearing() -> None:
    r1 = Resources.parse({"cpu": "250m", "memory": "1Gi"})
    q1 = parse_quantity("7Ki")
    quantity_mod._CACHE.clear()
    resources_mod._PARSED.clear()
    assert Resources.parse({"cpu": "250m", "memory": "1Gi"}) == r1
    assert parse_quantity("7Ki") == q1


@settings(deadline=None, max_examples=40)
@given(st.lists(needs_for("c1"), max_size=4))
def test_cached_and_uncached_rollups_agree(needs: list[object]) -> None:
    from bigfleet.wire.needs import rollup_to_proto

    pb = rollup_to_proto("c1", needs)  # type: ignore[arg-type]
    _, warm = rollup_from_proto(pb, 1)
    _, hot = rollup_from_proto(pb, 1)
    wire_mod._PROFILE_CACHE.clear()
    resources_mod._PARSED.clear()
    quantity_mod._CACHE.clear()
    _, cold = rollup_from_proto(pb, 1)
    assert warm == hot == cold


@settings(deadline=None, max_examples=25)
@given(st.data())
def test_replicas_applying_the_same_commands_agree(data: st.DataObject) -> None:
    """Raft replicas run the same replace() sequence; their tables must be identical."""
    commands = data.draw(
        st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 3)), max_size=8)
    )
    a, b = NeedsTable(), NeedsTable()
    for now, (cluster, n) in enumerate(commands, start=1):
        needs = data.draw(st.lists(needs_for(cluster), max_size=n))
        assert a.replace(cluster, needs, now) == b.replace(cluster, list(needs), now)
    assert a.snapshot() == b.snapshot()
    assert a.generation == b.generation and a.cluster_generations() == b.cluster_generations()
