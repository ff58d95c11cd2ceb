"""Structural invariants of a machine record (the same rules whether it came from the wire or the engine)."""

from __future__ import annotations

import math

from bigfleet.machine.record import Machine
from bigfleet.machine.state import MachineState
from bigfleet.needs.errors import ValidationError

MAX_ID_LEN = 253
MAX_ERROR_LEN = 4096

# Per state: must a host be set / may a cluster be set / must a cluster be set.
_S = MachineState
_HOST_REQUIRED = frozenset({_S.IDLE, _S.CONFIGURING, _S.CONFIGURED, _S.DRAINING, _S.DELETING})
_HOST_FORBIDDEN = frozenset({_S.SPECULATIVE})
_CLUSTER_REQUIRED = frozenset({_S.CONFIGURED, _S.DRAINING})
_CLUSTER_ALLOWED = frozenset({_S.CONFIGURING, _S.CONFIGURED, _S.DRAINING, _S.FAILED})


def check_cost_fields(price_per_hour: float, interruption_probability: float) -> None:
    if math.isnan(price_per_hour) or math.isinf(price_per_hour) or price_per_hour < 0:
        raise ValidationError("price_per_hour", f"must be finite and >= 0, got {price_per_hour!r}")
    if math.isnan(interruption_probability) or not 0.0 <= interruption_probability <= 1.0:
        raise ValidationError(
            "interruption_probability", f"must be in [0, 1], got {interruption_probability!r}"
        )


def check_invariant(m: Machine) -> None:
    """Raise `ValidationError` unless `m` is structurally sound for its state.

    Speculative: no host, no cluster. Creating: no cluster (a host may already be attached).
    Idle/Deleting: host, no cluster. Configuring: host, cluster optional. Configured/Draining: host
    and cluster. Failed: `last_error` set. Every state: price finite ≥ 0, probability in [0, 1].
    """
    if not m.id:
        raise ValidationError("id", "must not be empty")
    if len(m.id) > MAX_ID_LEN:
        raise ValidationError("id", f"longer than {MAX_ID_LEN} characters")
    st = m.state
    if st is MachineState.UNSPECIFIED or type(st) is not MachineState:
        raise ValidationError("state", f"invalid state {st!r}")
    s = m.shape
    check_cost_fields(s.price_per_hour, s.interruption_probability)
    has_host = bool(m.host_provider or m.host_ref)
    if st in _HOST_REQUIRED and not has_host:
        raise ValidationError("host", f"{st.name} machine must have a host")
    if st in _HOST_FORBIDDEN and has_host:
        raise ValidationError("host", f"{st.name} machine must not have a host")
    if st in _CLUSTER_REQUIRED and not m.cluster:
        raise ValidationError("cluster", f"{st.name} machine must be bound to a cluster")
    if m.cluster and st not in _CLUSTER_ALLOWED:
        raise ValidationError("cluster", f"{st.name} machine must not be bound to a cluster")
    if st is MachineState.FAILED and not m.last_error:
        raise ValidationError("last_error", "FAILED machine must say why")


def rejection_reason(err: ValidationError) -> str:
    """The `reason` label of ``bigfleet_shard_machines_rejected_total`` for a rejected record."""
    if err.field.startswith("price_per_hour"):
        return "price"
    if err.field.startswith("interruption_probability"):
        return "interruption_probability"
    return "structural"
