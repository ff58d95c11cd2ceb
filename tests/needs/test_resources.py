"""Resources: exact vector arithmetic in milli-units, validation of wire vectors."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigfleet.needs import EMPTY, Resources, ValidationError

from .strategies import resources


def R(**kw: int) -> Resources:
    return Resources.from_milli({k.replace("_", "."): v for k, v in kw.items()})


def test_parse_and_wire() -> None:
    r = Resources.parse({"cpu": "500m", "memory": "2Gi", "nvidia.com/gpu": "1", "zero": "0"})
    assert r.get("cpu") == 500
    assert r.get("memory") == 2 * (1 << 30) * 1000
    assert r.get("nvidia.com/gpu") == 1000
    assert r.get("absent") == 0
    assert "zero" not in r  # zero dimensions are dropped: equal vectors are equal
    assert r.to_wire() == {"cpu": "500m", "memory": "2Gi", "nvidia.com/gpu": "1"}
    assert r.names() == ("cpu", "memory", "nvidia.com/gpu")
    assert len(r) == 3


@pytest.mark.parametrize(
    ("wire", "field"),
    [
        ({"cpu": "-1"}, 'x["cpu"]'),
        ({"cpu": "lots"}, 'x["cpu"]'),
        ({"": "1"}, 'x[""]'),
        ({"bad name": "1"}, 'x["bad name"]'),
        ({"a\x00": "1"}, 'x["a\x00"]'),
        ({"x" * 400: "1"}, f'x["{"x" * 400}"]'),
    ],
)
def test_parse_rejects(wire: dict[str, str], field: str) -> None:
    with pytest.raises(ValidationError) as ei:
        Resources.parse(wire, "x")
    assert ei.value.field == field


def test_parse_rejects_too_many_dimensions() -> None:
    with pytest.raises(ValidationError):
        Resources.parse({f"r{i}": "1" for i in range(65)}, "x")


def test_from_milli_rejects_negative_and_non_int() -> None:
    with pytest.raises(ValueError):
        Resources.from_milli({"cpu": -1})
    with pytest.raises(TypeError):
        Resources.from_milli({"cpu": 1.5})  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        Resources.from_milli({"cpu": True})  # bool is not a quantity


def test_arithmetic() -> None:
    a = R(cpu=2000, memory=4000)
    b = R(cpu=500, gpu=1000)
    assert a + b == R(cpu=2500, memory=4000, gpu=1000)
    assert (a + b) - b == a
    with pytest.raises(ValueError):
        _ = a - b  # gpu would go negative
    assert a.saturating_sub(b) == R(cpu=1500, memory=4000)
    assert b.sub_floor0(a) == R(gpu=1000)
    assert a.max(b) == R(cpu=2000, memory=4000, gpu=1000)
    assert a.min(b) == R(cpu=500)
    assert a.scale(3) == R(cpu=6000, memory=12000)
    assert a.scale(0) == EMPTY and a.scale(-1) == EMPTY and a.scale(1) is a
    assert a.times_fits(R(cpu=500)) == 4
    assert a.times_fits(R(cpu=500, gpu=1)) == 0


def test_fits_and_covers() -> None:
    small = R(cpu=1000)
    big = R(cpu=2000, memory=1)
    assert small.fits_in(big) and big.covers(small)
    assert not big.fits_in(small)
    assert EMPTY.fits_in(small) and EMPTY.fits_in(EMPTY)
    assert not R(gpu=1).fits_in(big)  # a dimension the other lacks counts as 0
    assert small.fits_in(small)


def test_zero_and_truthiness() -> None:
    assert EMPTY.is_zero() and not EMPTY
    assert Resources.parse({"cpu": "0"}).is_zero()
    assert not R(cpu=1).is_zero() and R(cpu=1)


def test_immutable_hashable_picklable() -> None:
    r = R(cpu=1000)
    with pytest.raises(AttributeError):
        r._items = ()
    assert hash(r) == hash(Resources.parse({"cpu": "1"}))
    assert {r: 1}[Resources.parse({"cpu": "1000m"})] == 1
    assert pickle.loads(pickle.dumps(r)) == r
    assert repr(r) == "Resources(cpu=1)"


@settings(deadline=None)
@given(resources, resources)
def test_add_sub_inverse(a: Resources, b: Resources) -> None:
    assert (a + b) - b == a
    assert a + b == b + a
    assert a.fits_in(a + b)


@settings(deadline=None)
@given(resources, resources)
def test_saturating_sub_properties(a: Resources, b: Resources) -> None:
    d = a.saturating_sub(b)
    assert d.fits_in(a)
    assert a.fits_in(d + b)
    assert d.is_zero() == a.fits_in(b)


@settings(deadline=None)
@given(resources, resources, resources)
def test_max_is_least_upper_bound(a: Resources, b: Resources, c: Resources) -> None:
    m = a.max(b)
    assert a.fits_in(m) and b.fits_in(m)
    if a.fits_in(c) and b.fits_in(c):
        assert m.fits_in(c)


@settings(deadline=None)
@given(resources, st.integers(min_value=0, max_value=50))
def test_scale_is_repeated_addition(a: Resources, k: int) -> None:
    total = EMPTY
    for _ in range(k):
        total = total + a
    assert a.scale(k) == total


@settings(deadline=None)
@given(resources)
def test_wire_round_trip(a: Resources) -> None:
    assert Resources.parse(a.to_wire()) == a
