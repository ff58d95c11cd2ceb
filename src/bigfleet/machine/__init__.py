"""Supply: machine states and transitions, the compact `Machine` record, `Inventory`.

Pure (no I/O, no clock reads): time is always passed in. Import everything from here; the proto
conversions and shard_metadata keys are in `bigfleet.wire.machine`.
"""

from bigfleet.machine.inventory import DuplicateMachine, Inventory, StateView, UnknownMachine
from bigfleet.machine.labels import DEFAULT_INTERNER, EMPTY_LABELS, Interner, Labels
from bigfleet.machine.record import (
    INSTANCE_TYPE_LABEL,
    NO_ASSIGNMENT,
    ZONE_LABEL,
    Assignment,
    Machine,
    MachineShape,
    effective_cost,
)
from bigfleet.machine.state import (
    ALL_STATES,
    STABLE_STATES,
    TRANSITIONAL_STATES,
    TRANSITIONS,
    CapacityType,
    IllegalTransition,
    MachineState,
    can_transition,
    check_transition,
)
from bigfleet.machine.validate import check_cost_fields, check_invariant, rejection_reason
from bigfleet.needs.errors import ValidationError

__all__ = [
    "ALL_STATES",
    "DEFAULT_INTERNER",
    "EMPTY_LABELS",
    "INSTANCE_TYPE_LABEL",
    "NO_ASSIGNMENT",
    "STABLE_STATES",
    "TRANSITIONAL_STATES",
    "TRANSITIONS",
    "ZONE_LABEL",
    "Assignment",
    "CapacityType",
    "DuplicateMachine",
    "IllegalTransition",
    "Interner",
    "Inventory",
    "Labels",
    "Machine",
    "MachineShape",
    "MachineState",
    "StateView",
    "UnknownMachine",
    "ValidationError",
    "can_transition",
    "check_cost_fields",
    "check_invariant",
    "check_transition",
    "effective_cost",
    "rejection_reason",
]
