"""Machine builders for tests: a structurally valid record for any state."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from bigfleet.machine import CapacityType, Machine, MachineState
from bigfleet.needs import MAX_MILLI, Resources

CPU4 = Resources.parse({"cpu": "4", "memory": "16Gi"})


def valid_machine(mid: str, state: MachineState, **over: Any) -> Machine:
    """A machine satisfying the invariant for `state` (host/cluster/last_error as required)."""
    kw: dict[str, Any] = {
        "instance_type": "m5.xlarge",
        "zone": "eu-1a",
        "capacity_type": CapacityType.ON_DEMAND,
        "price_per_hour": 0.192,
        "interruption_probability": 0.0,
        "labels": {"pool": "general"},
        "resources": CPU4,
    }
    if state not in (MachineState.SPECULATIVE, MachineState.CREATING):
        kw.update(host_provider="fake", host_ref=f"h-{mid}")
    if state in (MachineState.CONFIGURING, MachineState.CONFIGURED, MachineState.DRAINING):
        kw.update(cluster="c1", node_name=f"node-{mid}")
    if state is MachineState.FAILED:
        kw.update(last_error="boom")
    kw.update(over)
    return Machine(mid, state, **kw)


label_text = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._", min_size=1, max_size=12)
resources = st.dictionaries(
    st.sampled_from(["cpu", "memory", "nvidia.com/gpu", "ephemeral-storage"]),
    st.integers(min_value=0, max_value=MAX_MILLI // 64),
    max_size=4,
).map(Resources.from_milli)
