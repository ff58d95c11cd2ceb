"""Penalty buckets: every bound, rounding up, the inverse, and a NaN-free total order."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigfleet.needs import (
    PenaltyBucket,
    ValidationError,
    bucket_dollars,
    bucket_from_dollars,
    dollars_sort_key,
    penalty_sort_key,
)

FINITE = [b for b in PenaltyBucket if PenaltyBucket.HALF_DOLLAR <= b <= PenaltyBucket.B8388608]


def test_enum_values_match_the_wire() -> None:
    values = {b.name: int(b) for b in PenaltyBucket}
    assert values["UNSPECIFIED"] == 0 and values["ZERO"] == 1 and values["HALF_DOLLAR"] == 2
    assert values["B1"] == 3 and values["B8388608"] == 26 and values["PINNED"] == 27
    for k in range(24):
        assert PenaltyBucket[f"B{1 << k}"] == 3 + k


@pytest.mark.parametrize("bucket", FINITE)
def test_every_boundary(bucket: PenaltyBucket) -> None:
    bound = bucket_dollars(bucket)
    # exactly the bound lands in the bucket; just above lands in the next one; just below (above the
    # previous bound) stays in it.
    assert bucket_from_dollars(bound) is bucket
    assert bucket_from_dollars(math.nextafter(bound, math.inf)) is PenaltyBucket(bucket + 1)
    below = math.nextafter(bound, 0)
    assert bucket_from_dollars(below) is bucket
    if bucket > PenaltyBucket.HALF_DOLLAR:
        prev_bound = bucket_dollars(bucket - 1)
        assert bucket_from_dollars(math.nextafter(prev_bound, math.inf)) is bucket
        assert bucket_from_dollars((prev_bound + bound) / 2) is bucket


@pytest.mark.parametrize(
    ("dollars", "bucket"),
    [
        (0.0, PenaltyBucket.ZERO),
        (-0.0, PenaltyBucket.ZERO),
        (5e-324, PenaltyBucket.HALF_DOLLAR),
        (0.5, PenaltyBucket.HALF_DOLLAR),
        (0.51, PenaltyBucket.B1),
        (1.01, PenaltyBucket.B2),
        (3, PenaltyBucket.B4),
        (8000, PenaltyBucket.B8192),
        (8388608, PenaltyBucket.B8388608),
        (8388608.000001, PenaltyBucket.PINNED),
        (20_000_000, PenaltyBucket.PINNED),
        (math.inf, PenaltyBucket.PINNED),
        (1e308, PenaltyBucket.PINNED),
    ],
)
def test_examples(dollars: float, bucket: PenaltyBucket) -> None:
    assert bucket_from_dollars(dollars) is bucket


@pytest.mark.parametrize("bad", [math.nan, -0.01, -math.inf, -1e-300])
def test_rejects(bad: float) -> None:
    with pytest.raises(ValidationError) as ei:
        bucket_from_dollars(bad, "penalty")
    assert ei.value.field == "penalty"


def test_dollars_of_special_buckets() -> None:
    assert bucket_dollars(PenaltyBucket.UNSPECIFIED) == 0.0
    assert bucket_dollars(PenaltyBucket.ZERO) == 0.0
    assert bucket_dollars(PenaltyBucket.HALF_DOLLAR) == 0.5
    assert bucket_dollars(PenaltyBucket.PINNED) == math.inf
    with pytest.raises(ValueError):
        bucket_dollars(28)
    with pytest.raises(ValueError):
        bucket_dollars(-1)


def test_labels() -> None:
    assert PenaltyBucket.UNSPECIFIED.label == "unspecified"
    assert PenaltyBucket.ZERO.label == "0"
    assert PenaltyBucket.HALF_DOLLAR.label == "0.5"
    assert PenaltyBucket.B8388608.label == "8388608"
    assert PenaltyBucket.PINNED.label == "pinned"
    assert len({b.label for b in PenaltyBucket}) == 28


def test_sort_key_total_order_pinned_last() -> None:
    ordered = sorted(PenaltyBucket, key=penalty_sort_key)
    assert ordered[-1] is PenaltyBucket.PINNED
    assert penalty_sort_key(PenaltyBucket.UNSPECIFIED) == penalty_sort_key(PenaltyBucket.ZERO)
    keys = [penalty_sort_key(b) for b in PenaltyBucket]
    assert all(isinstance(k, int) for k in keys)
    assert dollars_sort_key(math.nan) == 0.0 and dollars_sort_key(math.inf) == math.inf


@settings(deadline=None)
@given(st.floats(min_value=0, allow_nan=False, allow_infinity=True))
def test_round_up_property(x: float) -> None:
    b = bucket_from_dollars(x)
    assert bucket_dollars(b) >= x
    if b not in (PenaltyBucket.ZERO, PenaltyBucket.HALF_DOLLAR):
        # the previous bucket's bound is strictly below x: the smallest bound that holds x
        assert bucket_dollars(b - 1) < x


@settings(deadline=None)
@given(st.floats(min_value=0, allow_nan=False), st.floats(min_value=0, allow_nan=False))
def test_monotone(x: float, y: float) -> None:
    if x <= y:
        assert bucket_from_dollars(x) <= bucket_from_dollars(y)
