"""Requirement matching per operator, canonical values, spread clamping."""

from __future__ import annotations

import pytest

from bigfleet.needs import Operator, Requirement, TopologySpread, WhenUnsatisfiable, matches_all

LABELS = {"zone": "a", "pool": "gpu"}


@pytest.mark.parametrize(
    ("op", "values", "labels", "expected"),
    [
        (Operator.IN, ("a", "b"), LABELS, True),
        (Operator.IN, ("b",), LABELS, False),
        (Operator.IN, ("a",), {}, False),
        (Operator.NOT_IN, ("b",), LABELS, True),
        (Operator.NOT_IN, ("a",), LABELS, False),
        (Operator.NOT_IN, ("a",), {}, True),  # absent key passes NotIn
        (Operator.EXISTS, (), LABELS, True),
        (Operator.EXISTS, (), {}, False),
        (Operator.DOES_NOT_EXIST, (), LABELS, False),
        (Operator.DOES_NOT_EXIST, (), {}, True),
        (Operator.SAME, (), LABELS, True),
        (Operator.SAME, (), {}, False),
        (Operator.SAME, ("a", "c"), LABELS, True),
        (Operator.SAME, ("c",), LABELS, False),
        (Operator.UNSPECIFIED, (), LABELS, False),
        (Operator.UNSPECIFIED, ("a",), LABELS, False),
    ],
)
def test_matches(op: Operator, values: tuple[str, ...], labels: dict[str, str], expected: bool) -> None:
    assert Requirement("zone", op, values).matches(labels) is expected


def test_values_are_canonical() -> None:
    a = Requirement("zone", Operator.IN, ("b", "a", "b"))
    b = Requirement("zone", Operator.IN, ("a", "b"))
    assert a == b and hash(a) == hash(b)
    assert a.values == ("a", "b")
    assert Requirement.of("zone", 1, ["b", "a"]) == b
    assert Requirement("zone", 1, ()).operator is Operator.IN  # type: ignore[arg-type]


def test_k8s_names() -> None:
    for op in Operator:
        if op is Operator.UNSPECIFIED:
            continue
        assert Operator.from_k8s_name(op.k8s_name) is op
    assert [o.k8s_name for o in Operator][1:] == ["In", "NotIn", "Exists", "DoesNotExist", "Same"]
    with pytest.raises(ValueError):
        Operator.from_k8s_name("Gt")


def test_matches_all() -> None:
    reqs = [Requirement("zone", Operator.IN, ("a",)), Requirement("pool", Operator.EXISTS)]
    assert matches_all(reqs, LABELS)
    assert not matches_all([*reqs, Requirement("x", Operator.EXISTS)], LABELS)
    assert matches_all([], {})


def test_spread() -> None:
    s = TopologySpread("zone", 0, WhenUnsatisfiable.DO_NOT_SCHEDULE)
    assert s.max_skew == 1 and s.strict
    assert not TopologySpread("zone", 2, WhenUnsatisfiable.SCHEDULE_ANYWAY).strict
    assert TopologySpread("zone", -5, 1) == TopologySpread("zone", 1, WhenUnsatisfiable.DO_NOT_SCHEDULE)  # type: ignore[arg-type]
