"""Conformance fault hooks any kit-based provider gets for free.

The conformance suite's ``fault`` and ``durability`` lanes need transitions
that fail, hang or succeed too late. They ask for them over the wire, by
cluster id and by labelled machines, once the provider was started with
``BIGFLEET_CONFORMANCE_FAULTS=1`` in its environment. Providers in other
languages implement the same conventions to certify those lanes:

- Configure to cluster ``fault-error`` fails at once;
  ``fault-timeout`` hangs until cancelled (the transition times out);
  ``fault-slow-ok`` ignores cancellation and succeeds after the timeout (the
  late success must be discarded); ``fault-readiness-block`` configures but the
  readiness gate never confirms; ``fault-drain-error`` configures fine and its
  later Drain fails; ``fault-hang`` hangs (the durability lane kills the
  provider meanwhile).
- Machines labelled ``conformance.fault/create=error`` fail Create.
- ``BIGFLEET_CONFORMANCE_TRANSITION_TIMEOUT`` (seconds, default 2) bounds every kind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

from bigfleet.provider.kit.backend import (
    Backend,
    ConfigureCall,
    CreateCall,
    CreateResult,
    DeleteCall,
    DrainCall,
)
from bigfleet.provider.kit.model import HostRef, Instance

ENV_ENABLE = "BIGFLEET_CONFORMANCE_FAULTS"
ENV_TIMEOUT = "BIGFLEET_CONFORMANCE_TRANSITION_TIMEOUT"
CREATE_FAULT_LABEL = ("conformance.fault/create", "error")
CREATE_FAULT_SLOTS = 8

CLUSTER_ERROR = "fault-error"
CLUSTER_TIMEOUT = "fault-timeout"
CLUSTER_SLOW_OK = "fault-slow-ok"
CLUSTER_READINESS_BLOCK = "fault-readiness-block"
CLUSTER_DRAIN_ERROR = "fault-drain-error"
CLUSTER_HANG = "fault-hang"


def faults_enabled(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(ENV_ENABLE, "") not in ("", "0", "false")


def fault_timeout(environ: dict[str, str] | None = None) -> float:
    env = os.environ if environ is None else environ
    return float(env.get(ENV_TIMEOUT, "2"))


class ConformanceFaults(Backend):
    """Wraps a backend and injects the conformance faults described above."""

    def __init__(self, inner: Backend, late_by: float = 1.0, timeout: float = 2.0) -> None:
        self.inner = inner
        self.late_by = late_by
        self.timeout = timeout

    @property
    def supports_delete(self) -> bool:
        return self.inner.supports_delete

    async def describe(self) -> list[Instance]:
        instances = await self.inner.describe()
        if not instances:
            return instances
        template = instances[0]
        extra = []
        for i in range(CREATE_FAULT_SLOTS):
            labels = {**template.labels, CREATE_FAULT_LABEL[0]: CREATE_FAULT_LABEL[1]}
            extra.append(dataclasses.replace(
                template, id=f"faultcreate-{i}", host=None, state=None, labels=labels,
                price_per_hour=template.price_per_hour, resources=dict(template.resources),
                allocatable=dict(template.allocatable),
            ))
        return [*instances, *extra]

    async def create_instance(self, call: CreateCall) -> CreateResult:
        if call.machine.labels.get(CREATE_FAULT_LABEL[0]) == CREATE_FAULT_LABEL[1]:
            raise RuntimeError("injected create fault")
        if call.machine.id.startswith("faultcreate-"):
            return CreateResult(HostRef("fault", f"host-{call.machine.id}"))
        return await self.inner.create_instance(call)

    async def configure_instance(self, call: ConfigureCall) -> None:
        if call.cluster_id == CLUSTER_ERROR:
            raise RuntimeError("injected configure fault")
        if call.cluster_id in (CLUSTER_TIMEOUT, CLUSTER_HANG):
            await asyncio.Event().wait()
        if call.cluster_id == CLUSTER_SLOW_OK:
            # Ignore cancellation on purpose: this is the late success the kit must drop.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.timeout + self.late_by
            while loop.time() < deadline:
                try:
                    await asyncio.sleep(deadline - loop.time())
                except asyncio.CancelledError:
                    continue
            return None
        await self.inner.configure_instance(call)

    async def confirm_node_ready(self, call: ConfigureCall) -> None:
        if call.cluster_id == CLUSTER_READINESS_BLOCK:
            await asyncio.Event().wait()
        await self.inner.confirm_node_ready(call)

    async def drain_instance(self, call: DrainCall) -> None:
        if call.machine.cluster == CLUSTER_DRAIN_ERROR:
            raise RuntimeError("injected drain fault")
        await self.inner.drain_instance(call)

    async def delete_instance(self, call: DeleteCall) -> None:
        await self.inner.delete_instance(call)
