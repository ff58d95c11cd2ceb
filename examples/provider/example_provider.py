"""A complete BigFleet capacity provider in under 100 lines, built on the provider kit.

The "cloud" here is a dict, so the example runs anywhere; swap the four
methods for calls to your substrate's API. Everything else (state machine,
fencing, idempotency, List revisions, durability, timeouts, health) is the
kit's. CI certifies this file with every conformance lane:

    bigfleet conformance --lanes core,fault,durability,scale --provider-cmd \\
      "python examples/provider/example_provider.py --listen {listen} --state-file {state_file} --seed-count {seed_count}"
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from bigfleet.provider.kit import (
    Backend,
    CapacityType,
    ConfigureCall,
    CreateCall,
    CreateResult,
    DeleteCall,
    DrainCall,
    HostRef,
    Instance,
)
from bigfleet.provider.kit.runner import add_common_args, run

SHAPE = {"cpu": "4", "memory": "16Gi"}


class ToyCloud(Backend):
    """Substrate actions only: the kit has already validated, fenced and recorded each call."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.servers: dict[str, str] = {}  # operation id -> server name: creates are idempotent

    async def describe(self) -> list[Instance]:
        # Every third slot is spot capacity: cheaper, but it may be interrupted.
        return [
            Instance(
                id=f"toy-{i:04d}",
                instance_type="toy-standard-4",
                zone=f"toy-zone-{'abc'[i % 3]}",
                capacity_type=CapacityType.SPOT if i % 3 == 0 else CapacityType.ON_DEMAND,
                price_per_hour=0.12 if i % 3 == 0 else 0.40,
                interruption_probability=0.05 if i % 3 == 0 else 0.0,
                resources=dict(SHAPE),
                allocatable={"cpu": "3800m", "memory": "15Gi"},
                labels={"example.com/pool": "default"},
            )
            for i in range(self.slots)
        ]

    async def create_instance(self, call: CreateCall) -> CreateResult:
        await asyncio.sleep(0.01)  # a real API call goes here; use the op id as its idempotency token
        name = self.servers.setdefault(call.operation_id, f"srv-{call.machine.id}-{len(self.servers)}")
        return CreateResult(host=HostRef(provider="toycloud", ref=name))

    async def configure_instance(self, call: ConfigureCall) -> None:
        # Deliver call.bootstrap_blob to the host so it joins call.cluster_id.
        await asyncio.sleep(0.01)

    async def drain_instance(self, call: DrainCall) -> None:
        # Cordon, evict within call.grace_period_seconds, remove the node from its cluster.
        await asyncio.sleep(0.01)

    async def delete_instance(self, call: DeleteCall) -> None:
        await asyncio.sleep(0.01)  # release the host; the slot becomes SPECULATIVE again


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="example BigFleet provider")
    add_common_args(parser, default_listen="127.0.0.1:9500")
    parser.add_argument("--seed-count", type=int, default=32, help="speculative slots on first boot")
    args = parser.parse_args(argv)
    return run(ToyCloud(args.seed_count), args, component="example-provider")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
