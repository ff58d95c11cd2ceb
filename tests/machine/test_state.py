"""Every legal and illegal transition of the eight-state machine."""

from __future__ import annotations

import itertools

import pytest

from bigfleet.machine import (
    ALL_STATES,
    STABLE_STATES,
    TRANSITIONAL_STATES,
    TRANSITIONS,
    CapacityType,
    IllegalTransition,
    MachineState,
    ValidationError,
    can_transition,
    check_transition,
)

S = MachineState

# Transcribed from decision-engine.md §4 (13 edges), independent of TRANSITIONS.
LEGAL = {
    (S.SPECULATIVE, S.CREATING),
    (S.CREATING, S.IDLE),
    (S.CREATING, S.FAILED),
    (S.IDLE, S.CONFIGURING),
    (S.IDLE, S.DELETING),
    (S.CONFIGURING, S.CONFIGURED),
    (S.CONFIGURING, S.FAILED),
    (S.CONFIGURING, S.IDLE),
    (S.CONFIGURED, S.DRAINING),
    (S.DRAINING, S.IDLE),
    (S.DRAINING, S.FAILED),
    (S.DELETING, S.SPECULATIVE),
    (S.DELETING, S.FAILED),
}
ALL_PAIRS = list(itertools.product(list(MachineState), repeat=2))


def test_enum_values_match_the_wire() -> None:
    assert [int(s) for s in MachineState] == list(range(9))
    assert [s.name for s in MachineState][1:] == [
        "SPECULATIVE", "CREATING", "IDLE", "CONFIGURING", "CONFIGURED", "DRAINING", "DELETING", "FAILED"
    ]
    assert [int(c) for c in CapacityType] == [0, 1, 2, 3, 4]
    assert len(ALL_STATES) == 8 and S.UNSPECIFIED not in ALL_STATES


def test_table_has_exactly_thirteen_edges() -> None:
    edges = {(a, b) for a, tos in TRANSITIONS.items() for b in tos}
    assert edges == LEGAL
    assert len(edges) == 13


@pytest.mark.parametrize(("a", "b"), sorted(LEGAL))
def test_legal(a: MachineState, b: MachineState) -> None:
    check_transition(a, b)
    assert can_transition(a, b)


@pytest.mark.parametrize(("a", "b"), [p for p in ALL_PAIRS if p not in LEGAL])
def test_illegal(a: MachineState, b: MachineState) -> None:
    assert not can_transition(a, b)
    with pytest.raises(IllegalTransition) as ei:
        check_transition(a, b, "m-1")
    assert ei.value.from_state is a and ei.value.to_state is b and ei.value.machine_id == "m-1"
    assert isinstance(ei.value, ValidationError) and ei.value.field == "state"


def test_failed_is_terminal_and_only_reached_from_transitional_states() -> None:
    assert TRANSITIONS[S.FAILED] == frozenset()
    into_failed = {a for a, b in LEGAL if b is S.FAILED}
    assert into_failed <= TRANSITIONAL_STATES
    assert S.FAILED not in STABLE_STATES


def test_stable_states() -> None:
    assert {S.SPECULATIVE, S.IDLE, S.CONFIGURED} == STABLE_STATES
    assert all(s.is_stable for s in STABLE_STATES)
    assert not S.FAILED.is_stable and not S.CREATING.is_stable
    assert S.DRAINING.is_transitional and not S.IDLE.is_transitional
    assert S.IDLE.label == "idle"


def test_idle_is_the_hub_between_clusters() -> None:
    # Configured can never be re-pointed directly: it must pass through Draining and Idle.
    assert TRANSITIONS[S.CONFIGURED] == {S.DRAINING}
    assert S.CONFIGURING not in TRANSITIONS[S.CONFIGURED]
    assert S.DELETING not in TRANSITIONS[S.CONFIGURED]
