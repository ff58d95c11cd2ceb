"""The machine state machine: eight states, thirteen legal edges, FAILED terminal."""

from __future__ import annotations

from enum import IntEnum

from bigfleet.needs.errors import ValidationError


class MachineState(IntEnum):
    """`MachineState` proto values."""

    UNSPECIFIED = 0
    SPECULATIVE = 1
    CREATING = 2
    IDLE = 3
    CONFIGURING = 4
    CONFIGURED = 5
    DRAINING = 6
    DELETING = 7
    FAILED = 8

    @property
    def is_stable(self) -> bool:
        """Speculative, Idle and Configured; the engine allocates only from these (Failed is not stable)."""
        return self in STABLE_STATES

    @property
    def is_transitional(self) -> bool:
        return self in TRANSITIONAL_STATES

    @property
    def label(self) -> str:
        """Lower-case name for metric labels and logs (``"idle"``)."""
        return self.name.lower()


class CapacityType(IntEnum):
    """`CapacityType` proto values."""

    UNSPECIFIED = 0
    BARE_METAL = 1
    RESERVED = 2
    ON_DEMAND = 3
    SPOT = 4

    @property
    def label(self) -> str:
        return self.name.lower()


STABLE_STATES = frozenset({MachineState.SPECULATIVE, MachineState.IDLE, MachineState.CONFIGURED})
TRANSITIONAL_STATES = frozenset(
    {MachineState.CREATING, MachineState.CONFIGURING, MachineState.DRAINING, MachineState.DELETING}
)
#: Real states (everything but UNSPECIFIED).
ALL_STATES = tuple(s for s in MachineState if s is not MachineState.UNSPECIFIED)

_S = MachineState
#: from-state → the states it may move to. Idle is the hub: a move between clusters is always
#: Configured → Draining → Idle → Configuring → Configured. Failed has no exits (cleaned up out of band).
TRANSITIONS: dict[MachineState, frozenset[MachineState]] = {
    _S.SPECULATIVE: frozenset({_S.CREATING}),
    _S.CREATING: frozenset({_S.IDLE, _S.FAILED}),
    _S.IDLE: frozenset({_S.CONFIGURING, _S.DELETING}),
    # Configuring → Idle is the rollback when a bootstrap is abandoned before the provider acted.
    _S.CONFIGURING: frozenset({_S.CONFIGURED, _S.FAILED, _S.IDLE}),
    _S.CONFIGURED: frozenset({_S.DRAINING}),
    _S.DRAINING: frozenset({_S.IDLE, _S.FAILED}),
    _S.DELETING: frozenset({_S.SPECULATIVE, _S.FAILED}),
    _S.FAILED: frozenset(),
    _S.UNSPECIFIED: frozenset(),
}


class IllegalTransition(ValidationError):
    """A state change the state machine does not allow."""

    def __init__(self, from_state: MachineState, to_state: MachineState, machine_id: str = "") -> None:
        who = f"machine {machine_id!r}: " if machine_id else ""
        super().__init__("state", f"{who}illegal transition {from_state.name} -> {to_state.name}")
        self.from_state = from_state
        self.to_state = to_state
        self.machine_id = machine_id


def can_transition(from_state: MachineState, to_state: MachineState) -> bool:
    return to_state in TRANSITIONS.get(from_state, frozenset())


def check_transition(from_state: MachineState, to_state: MachineState, machine_id: str = "") -> None:
    """Raise `IllegalTransition` unless ``from_state → to_state`` is one of the 13 legal edges."""
    if to_state not in TRANSITIONS.get(from_state, frozenset()):
        raise IllegalTransition(from_state, to_state, machine_id)
