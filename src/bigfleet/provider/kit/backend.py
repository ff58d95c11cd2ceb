"""What a provider author implements: the substrate actions, nothing about the contract.

The kit calls these coroutines in the background, under a per-kind timeout,
after it has already moved the machine to the transitional state and answered
the shard. Blocking SDKs should be wrapped in ``asyncio.to_thread``. A method
that raises marks the machine FAILED with the exception text as ``last_error``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from bigfleet.provider.kit.model import HostRef, Instance, MachineRecord


@dataclass(frozen=True)
class CreateCall:
    machine: MachineRecord
    # Stable across retries of the same transition: use it as the substrate's idempotency token.
    operation_id: str


@dataclass(frozen=True)
class CreateResult:
    host: HostRef
    # When not None, replace the machine's request shape / hardware capacity.
    resources: dict[str, str] | None = None
    allocatable: dict[str, str] | None = None


@dataclass(frozen=True)
class ConfigureCall:
    machine: MachineRecord
    cluster_id: str
    bootstrap_blob: bytes
    operation_id: str
    shard_metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DrainCall:
    machine: MachineRecord
    grace_period_seconds: int
    operation_id: str


@dataclass(frozen=True)
class DeleteCall:
    machine: MachineRecord
    operation_id: str


class Backend(abc.ABC):
    """Substrate actions for one provider. Override ``delete_instance`` to support Delete."""

    @abc.abstractmethod
    async def describe(self) -> list[Instance]:
        """Every machine the substrate offers (SPECULATIVE slots and existing IDLE hosts)."""

    @abc.abstractmethod
    async def create_instance(self, call: CreateCall) -> CreateResult:
        """Turn a speculative slot into a real host; return its HostRef."""

    @abc.abstractmethod
    async def configure_instance(self, call: ConfigureCall) -> None:
        """Hand the host to ``call.cluster_id`` (deliver the bootstrap blob)."""

    @abc.abstractmethod
    async def drain_instance(self, call: DrainCall) -> None:
        """Take the host back from its cluster; it becomes IDLE when this returns."""

    async def delete_instance(self, call: DeleteCall) -> None:
        """Release the host; the slot becomes SPECULATIVE again. Optional."""
        raise NotImplementedError

    async def confirm_node_ready(self, call: ConfigureCall) -> None:
        """Optional readiness gate after configure; the machine stays CONFIGURING until it returns."""
        return None

    @property
    def supports_delete(self) -> bool:
        return type(self).delete_instance is not Backend.delete_instance
