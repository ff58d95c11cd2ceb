"""Leader election on a ``coordination.k8s.io/v1`` Lease, so two operator replicas never both hold
the Session.

The rule (as client-go's): a candidate may take the Lease when it is free, is
its own, or has not changed for ``lease_duration`` *as measured on the
candidate's own monotonic clock since it saw the last change* — so clocks on
different machines never need to agree. Writes carry the resourceVersion
that was read, so two candidates racing for the same Lease cannot both win
(the loser gets 409). A leader that fails to renew for ``renew_deadline``
(< ``lease_duration``) stops leading — cancels the work it was doing — before
any other replica may take over. On a clean shutdown the Lease is released so
the standby takes over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kubernetes.aio import client

from bigfleet.observability import get_logger
from bigfleet.operator.kube import status_code

log = get_logger("bigfleet.operator.leader")


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    duration_s: int
    acquire_time: str
    renew_time: str
    transitions: int

    @classmethod
    def from_lease(cls, obj: dict[str, Any]) -> LeaseRecord:
        spec = obj.get("spec") or {}
        return cls(
            holder=str(spec.get("holderIdentity") or ""),
            duration_s=int(spec.get("leaseDurationSeconds") or 0),
            acquire_time=str(spec.get("acquireTime") or ""),
            renew_time=str(spec.get("renewTime") or ""),
            transitions=int(spec.get("leaseTransitions") or 0),
        )


def may_take(record: LeaseRecord | None, me: str, observed_at: float, now: float, lease_duration: float) -> bool:
    """Pure: whether ``me`` may write itself into the Lease now."""
    if record is None or not record.holder or record.holder == me:
        return True
    return now - observed_at >= lease_duration


class LeaseElector:
    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not lease_duration > renew_deadline > retry_period > 0:
            raise ValueError("need lease_duration > renew_deadline > retry_period > 0")
        self.coord: Any = client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_duration, self.renew_deadline, self.retry_period = lease_duration, renew_deadline, retry_period
        self.clock = clock
        self.observed: LeaseRecord | None = None
        self.observed_at = 0.0
        self.leading = asyncio.Event()
        self.terms = 0  # how many times this replica became leader

    def _body(self, rv: str | None, prev: LeaseRecord | None, acquire: dt.datetime | None) -> client.V1Lease:
        now = dt.datetime.now(dt.UTC)
        mine = prev is not None and prev.holder == self.identity
        spec = client.V1LeaseSpec(
            holder_identity=self.identity,
            lease_duration_seconds=max(1, round(self.lease_duration)),
            acquire_time=acquire if mine and acquire is not None else now,
            renew_time=now,
            lease_transitions=(prev.transitions if prev else 0) + (0 if mine or prev is None else 1),
        )
        meta = client.V1ObjectMeta(name=self.name, namespace=self.namespace, resource_version=rv or None)
        return client.V1Lease(api_version="coordination.k8s.io/v1", kind="Lease", metadata=meta, spec=spec)

    async def try_acquire_or_renew(self) -> bool:
        try:
            lease = await self.coord.read_namespaced_lease(self.name, self.namespace)
        except Exception as exc:
            if status_code(exc) != 404:
                log.warning("reading the Lease failed", error=str(exc)[:200])
                return False
            try:
                await self.coord.create_namespaced_lease(self.namespace, self._body(None, None, None))
            except Exception as cexc:
                if status_code(cexc) != 409:
                    log.warning("creating the Lease failed", error=str(cexc)[:200])
                return False
            self.observed, self.observed_at = None, self.clock()
            return True
        obj = self.coord.api_client.sanitize_for_serialization(lease)
        rec = LeaseRecord.from_lease(obj)
        if rec != self.observed:
            self.observed, self.observed_at = rec, self.clock()
        if not may_take(rec, self.identity, self.observed_at, self.clock(), self.lease_duration):
            return False
        try:
            acquire = lease.spec.acquire_time if lease.spec is not None else None
            await self.coord.replace_namespaced_lease(
                self.name, self.namespace, self._body(obj["metadata"]["resourceVersion"], rec, acquire))
        except Exception as exc:
            if status_code(exc) != 409:
                log.warning("updating the Lease failed", error=str(exc)[:200])
            return False
        return True

    async def release(self) -> None:
        """Give the Lease up (clean shutdown) so a standby need not wait for it to expire."""
        try:
            lease = await self.coord.read_namespaced_lease(self.name, self.namespace)
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = ""
            lease.spec.lease_duration_seconds = 1
            await self.coord.replace_namespaced_lease(self.name, self.namespace, lease)
        except Exception as exc:
            log.warning("releasing the Lease failed", error=str(exc)[:200])

    async def run(self, work: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Forever: wait to lead, run ``work`` while leading, cancel it the moment leadership is lost."""
        try:
            while True:
                while not await self.try_acquire_or_renew():
                    await asyncio.sleep(self.retry_period)
                last_renew = self.clock()
                self.terms += 1
                self.leading.set()
                log.info("leading", identity=self.identity, lease=f"{self.namespace}/{self.name}")
                task = asyncio.create_task(work())
                try:
                    while not task.done():
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(asyncio.shield(task), timeout=self.retry_period)
                        if task.done():
                            break
                        attempt_start = self.clock()
                        if await self.try_acquire_or_renew():
                            last_renew = attempt_start
                        elif self.clock() - last_renew >= self.renew_deadline:
                            log.warning("lost the Lease; stopping work", identity=self.identity)
                            break
                finally:
                    self.leading.clear()
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        except asyncio.CancelledError:
            await asyncio.shield(self.release())
            raise
