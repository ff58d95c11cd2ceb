# mypy: disable-error-code="arg-type,no-untyped-call,unused-ignore"
"""Machine record: sharing, immutability, replace, effective cost, invariants."""

from __future__ import annotations

import math
import pickle

import pytest

from bigfleet.machine import (
    INSTANCE_TYPE_LABEL,
    NO_ASSIGNMENT,
    ZONE_LABEL,
    Interner,
    Labels,
    Machine,
    MachineState,
    ValidationError,
    check_invariant,
    effective_cost,
    rejection_reason,
)
from bigfleet.needs import Operator, Requirement, Resources

from .helpers import CPU4, valid_machine

S = MachineState


def test_machines_of_one_type_share_their_shape() -> None:
    a = valid_machine("a", S.IDLE)
    b = valid_machine("b", S.IDLE, labels={"pool": "general"}, resources=Resources.parse({"memory": "16Gi", "cpu": "4"}))
    assert a.shape is b.shape
    assert a.labels is b.labels and a.resources is b.resources
    c = valid_machine("c", S.IDLE, price_per_hour=0.5)
    assert c.shape is not a.shape and c.labels is a.labels


def test_assignment_is_shared_and_empty_is_the_sentinel() -> None:
    a = valid_machine("a", S.CONFIGURED, assigned_priority=5, assigned_need_fingerprint="fp")
    b = valid_machine("b", S.CONFIGURED, assigned_priority=5, assigned_need_fingerprint="fp")
    assert a.assignment is b.assignment
    assert valid_machine("c", S.IDLE).assignment is NO_ASSIGNMENT


def test_immutable() -> None:
    m = valid_machine("a", S.IDLE)
    with pytest.raises(AttributeError):
        m.state = S.CONFIGURED  # type: ignore[misc]
    with pytest.raises(AttributeError):
        m.shape.price_per_hour = 1.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        m.labels._hash = 0  # type: ignore[misc]


def test_replace() -> None:
    m = valid_machine("a", S.IDLE)
    n = m.replace(state=S.CONFIGURING, cluster="c2", assigned_priority=9, assigned_reclamation_penalty_dollars=64.0)
    assert (n.state, n.cluster, n.assigned_priority, n.reclamation_penalty_dollars) == (S.CONFIGURING, "c2", 9, 64.0)
    assert n.shape is m.shape and m.state is S.IDLE  # original untouched
    p = n.replace(price_per_hour=1.5, labels={"pool": "x"})
    assert p.price_per_hour == 1.5 and p.labels == {"pool": "x"} and p.assigned_priority == 9
    assert p.instance_type == m.instance_type
    with pytest.raises(TypeError):
        m.replace(colour="blue")
    u = n.unassigned(S.IDLE, 77)
    assert u.cluster == "" and u.assignment is NO_ASSIGNMENT and u.state is S.IDLE and u.state_since_unix_nanos == 77


def test_equality_hash_pickle() -> None:
    m = valid_machine("a", S.CONFIGURED, assigned_group="g")
    assert m == valid_machine("a", S.CONFIGURED, assigned_group="g")
    assert m != m.replace(node_name="other")
    assert hash(m) == hash("a")
    assert pickle.loads(pickle.dumps(m)) == m
    assert "CONFIGURED" in repr(m)


def test_match_labels_include_instance_type_and_zone() -> None:
    m = valid_machine("a", S.IDLE, labels={"pool": "p", INSTANCE_TYPE_LABEL: "stale", ZONE_LABEL: "stale"})
    ml = m.match_labels
    assert ml[INSTANCE_TYPE_LABEL] == "m5.xlarge" and ml[ZONE_LABEL] == "eu-1a" and ml["pool"] == "p"
    assert m.labels[INSTANCE_TYPE_LABEL] == "stale"  # the provider's own labels are kept verbatim
    assert m.matches([Requirement(ZONE_LABEL, Operator.IN, ("eu-1a",)), Requirement("pool", Operator.EXISTS)])
    assert not m.matches([Requirement(ZONE_LABEL, Operator.IN, ("eu-1b",))])


def test_effective_allocatable() -> None:
    m = valid_machine("a", S.IDLE)
    assert m.effective_allocatable == CPU4  # (shapes are interned: an equal, earlier-made Resources may be the one returned)
    alloc = Resources.parse({"cpu": "3800m"})
    assert m.replace(allocatable=alloc).effective_allocatable == alloc


@pytest.mark.parametrize(
    ("price", "prob", "penalty", "expected"),
    [
        (1.0, 0.0, 100.0, 1.0),
        (1.0, 0.1, 100.0, 11.0),
        (1.0, 0.1, -5.0, 1.0),  # negative penalty counts as 0
        (1.0, 0.0, math.inf, 1.0),  # pinned x zero probability is not NaN
        (1.0, 0.5, math.inf, math.inf),
        (2.0, 0.5, math.nan, 2.0),  # a NaN penalty never poisons the order
    ],
)
def test_effective_cost(price: float, prob: float, penalty: float, expected: float) -> None:
    m = valid_machine("a", S.IDLE, price_per_hour=price, interruption_probability=prob)
    assert m.effective_cost(penalty) == expected
    assert effective_cost(price, prob, penalty) == expected
    assert not math.isnan(m.effective_cost(penalty))


@pytest.mark.parametrize(
    ("state", "over", "field"),
    [
        (S.SPECULATIVE, {"host_provider": "p"}, "host"),
        (S.SPECULATIVE, {"cluster": "c"}, "cluster"),
        (S.CREATING, {"cluster": "c"}, "cluster"),
        (S.IDLE, {"host_provider": "", "host_ref": ""}, "host"),
        (S.IDLE, {"cluster": "c"}, "cluster"),
        (S.DELETING, {"cluster": "c"}, "cluster"),
        (S.CONFIGURING, {"host_provider": "", "host_ref": ""}, "host"),
        (S.CONFIGURED, {"cluster": ""}, "cluster"),
        (S.DRAINING, {"cluster": ""}, "cluster"),
        (S.FAILED, {"last_error": ""}, "last_error"),
        (S.IDLE, {"price_per_hour": -0.01}, "price_per_hour"),
        (S.IDLE, {"price_per_hour": math.nan}, "price_per_hour"),
        (S.IDLE, {"price_per_hour": math.inf}, "price_per_hour"),
        (S.IDLE, {"interruption_probability": 1.01}, "interruption_probability"),
        (S.IDLE, {"interruption_probability": -0.1}, "interruption_probability"),
        (S.IDLE, {"interruption_probability": math.nan}, "interruption_probability"),
    ],
)
def test_invariant_violations(state: MachineState, over: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as ei:
        check_invariant(valid_machine("a", state, **over))
    assert ei.value.field == field


def test_invariant_accepts_valid_records_and_allowed_variants() -> None:
    for s in MachineState:
        if s is not S.UNSPECIFIED:
            check_invariant(valid_machine("a", s))
    check_invariant(valid_machine("a", S.CREATING, host_provider="p", host_ref="r"))  # host attached early
    check_invariant(valid_machine("a", S.CONFIGURING, cluster=""))  # cluster optional while configuring
    check_invariant(valid_machine("a", S.CREATING, assigned_need_fingerprint="fp", assigned_group="g"))
    with pytest.raises(ValidationError):
        check_invariant(valid_machine("", S.IDLE))
    with pytest.raises(ValidationError):
        check_invariant(Machine("a", S.UNSPECIFIED))


def test_rejection_reason() -> None:
    assert rejection_reason(ValidationError("price_per_hour", "x")) == "price"
    assert rejection_reason(ValidationError("interruption_probability", "x")) == "interruption_probability"
    assert rejection_reason(ValidationError("cluster", "x")) == "structural"


def test_interner_bounds_its_tables() -> None:
    it = Interner(max_entries=3)
    for i in range(10):
        it.intern("x", f"v{i}")
    assert it.sizes()["x"] <= 3
    lab = it.labels({"a": "b"})
    assert it.labels({"a": "b"}) is lab and isinstance(lab, Labels)
    assert it.labels({}) is it.labels(None)
