"""AvailableCapacityUpdate filter: rate limit per (cluster, profile), and only meaningful changes."""

from __future__ import annotations

from bigfleet.shard.availability import Availability, AvailabilityEmitter


def hint(count: int, confidence: int = 4, cost: float = 1.0) -> Availability:
    return Availability(count, confidence, cost, {})


def test_first_hint_is_due_and_an_unchanged_one_is_not() -> None:
    e = AvailabilityEmitter(5.0)
    assert e.due("c", "fp", hint(10), now=0.0)
    assert not e.due("c", "fp", hint(10), now=100.0)
    assert e.due("c", "other", hint(10), now=0.0)  # keyed per profile


def test_small_counts_change_by_one_and_large_counts_by_two_percent() -> None:
    e = AvailabilityEmitter(5.0)
    assert e.due("c", "small", hint(10), now=0.0)
    assert e.due("c", "small", hint(9), now=6.0)  # one machine of ten is a change
    assert e.due("c", "big", hint(50_000), now=0.0)
    assert not e.due("c", "big", hint(49_990), now=6.0)  # noise of a busy shape
    assert not e.due("c", "big", hint(49_001), now=12.0)  # still within 2 % of what was sent
    assert e.due("c", "big", hint(48_999), now=18.0)
    assert e.due("c", "big", hint(48_999, confidence=3), now=24.0)  # confidence always counts
    assert e.due("c", "big", hint(48_999, confidence=3, cost=2.0), now=30.0)  # so does cost
    assert e.due("c", "big", hint(0, confidence=1), now=36.0)


def test_a_change_inside_the_interval_is_deferred_not_lost() -> None:
    e = AvailabilityEmitter(5.0)
    assert e.due("c", "fp", hint(10), now=0.0)
    assert not e.due("c", "fp", hint(5), now=1.0)
    assert e.due("c", "fp", hint(5), now=5.5)


def test_forgetting_a_cluster_makes_its_hints_due_again_and_leaves_others() -> None:
    e = AvailabilityEmitter(5.0)
    for c in ("a", "b"):
        assert e.due(c, "fp1", hint(10), now=0.0)
        assert e.due(c, "fp2", hint(10), now=0.0)
    e.forget_cluster("a")  # its session ended: a new session gets every hint afresh
    e.forget_cluster("never-seen")
    assert e.due("a", "fp1", hint(10), now=1.0)
    assert e.due("a", "fp2", hint(10), now=1.0)
    assert not e.due("b", "fp1", hint(10), now=1.0)
    assert not e.due("b", "fp2", hint(10), now=1.0)
