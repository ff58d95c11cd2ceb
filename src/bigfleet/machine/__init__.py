"""Supply: machine states and transitions, the compact `Machine` record, `Inventory`, wire conversions.

Pure (no I/O, no clock reads): time is always passed in. Import everything from here.
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
from bigfleet.machine.wire import (
    HOSTNAME_LABEL,
    META_ASSIGNED_PRIORITY,
    META_GROUP,
    META_INTERRUPTION_PENALTY,
    META_NEED_FINGERPRINT,
    META_NODE_NAME,
    META_RECLAMATION_PENALTY,
    WELL_KNOWN_METADATA_KEYS,
    DecodedMetadata,
    decode_shard_metadata,
    encode_shard_metadata,
    format_go_float,
    machine_from_proto,
    machine_to_proto,
    parse_go_float,
)
from bigfleet.needs.errors import ValidationError

__all__ = [
    "ALL_STATES",
    "DEFAULT_INTERNER",
    "EMPTY_LABELS",
    "HOSTNAME_LABEL",
    "INSTANCE_TYPE_LABEL",
    "META_ASSIGNED_PRIORITY",
    "META_GROUP",
    "META_INTERRUPTION_PENALTY",
    "META_NEED_FINGERPRINT",
    "META_NODE_NAME",
    "META_RECLAMATION_PENALTY",
    "NO_ASSIGNMENT",
    "STABLE_STATES",
    "TRANSITIONAL_STATES",
    "TRANSITIONS",
    "WELL_KNOWN_METADATA_KEYS",
    "ZONE_LABEL",
    "Assignment",
    "CapacityType",
    "DecodedMetadata",
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
    "decode_shard_metadata",
    "effective_cost",
    "encode_shard_metadata",
    "format_go_float",
    "machine_from_proto",
    "machine_to_proto",
    "parse_go_float",
    "rejection_reason",
]
