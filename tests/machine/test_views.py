"""Labels mapping behaviour, StateView, ValidationError paths, NaN-free effective cost."""

from __future__ import annotations

import math
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from bigfleet.machine import EMPTY_LABELS, Inventory, Labels, MachineState, ValidationError, effective_cost

from .helpers import valid_machine

S = MachineState


def test_labels_is_an_immutable_hashable_mapping() -> None:
    a = Labels({"b": "2", "a": "1"})
    assert dict(a) == {"a": "1", "b": "2"} and len(a) == 2 and a["a"] == "1" and a.get("z") is None
    assert a == {"a": "1", "b": "2"} and a == Labels({"a": "1", "b": "2"}) and hash(a) == hash(Labels({"a": "1", "b": "2"}))
    assert a != Labels({"a": "1"}) and a != 5
    assert a.pairs() == (("a", "1"), ("b", "2")) and a.to_dict() == {"a": "1", "b": "2"}
    assert a.with_items({"c": "3"})["c"] == "3" and "c" not in a
    assert pickle.loads(pickle.dumps(a)) == a
    assert len(EMPTY_LABELS) == 0 and not EMPTY_LABELS
    assert "Labels(" in repr(a)


def test_state_view() -> None:
    inv = Inventory([valid_machine("a", S.IDLE, labels={"p": "1"}), valid_machine("b", S.IDLE, labels={"p": "2"}),
                     valid_machine("c", S.CONFIGURED)])
    view = inv.by_state(S.IDLE)
    assert len(view) == 2 and {m.id for m in view} == {"a", "b"}
    assert inv["a"] in view and inv["c"] not in view and "a" not in view
    groups = view.by_labels()
    assert len(groups) == 2 and all(len(ms) == 1 for _, ms in groups)
    inv.transition("a", S.CONFIGURING, 1, cluster="c1")
    assert len(view) == 1  # live


def test_validation_error_nesting() -> None:
    e = ValidationError("key", "bad")
    assert str(e) == "key: bad"
    assert e.nested("needs[0]").field == "needs[0].key"
    assert ValidationError('["cpu"]', "x").nested("min_unit").field == 'min_unit["cpu"]'
    assert ValidationError("", "x").nested("p").field == "p"
    assert e.nested("") is e
    assert str(ValidationError("", "just a message")) == "just a message"


@settings(deadline=None)
@given(
    st.floats(min_value=0, max_value=1e9),
    st.floats(min_value=0, max_value=1),
    st.floats(allow_nan=True, allow_infinity=True),
)
def test_effective_cost_never_nan(price: float, prob: float, penalty: float) -> None:
    c = effective_cost(price, prob, penalty)
    assert not math.isnan(c)
    assert c >= price
    m = valid_machine("m", S.IDLE, price_per_hour=price, interruption_probability=prob)
    assert m.effective_cost(penalty) == c
