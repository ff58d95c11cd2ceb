"""Kubernetes Events from the operator, deduplicated and rate-limited the way the Events API expects.

The rules are client-go's event recorder's, adapted to what the operator reports:

* **Dedupe.** An event with the same involved object, type and reason as one already written (and
  still remembered: an LRU of 4 096 keys) is not a new object: the existing Event's ``count`` is
  bumped and its ``lastTimestamp`` and ``message`` updated (a merge patch). If that Event is gone (the
  API server expires Events after an hour), a new one is created.
* **Rate limit.** A token bucket per involved object (burst 25, one token per 5 minutes, as
  client-go's spam filter) and one for the whole operator (``qps``/``burst``). An event that finds
  no token is dropped and counted (``bigfleet_operator_events_total{outcome="dropped"}``).
* **Never blocking.** Callers only queue (at most ``queue_max`` pending; beyond that events are
  dropped); one writer task talks to the API server.

Events are written through the core ``v1`` Events API (``events.k8s.io/v1`` serves the same objects;
``kubectl describe`` and ``kubectl get events`` show both). Cluster-scoped objects (Nodes,
UpcomingNodes) get their Events in the ``default`` namespace, as client-go does; a Namespace's go in
that namespace.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bigfleet.observability import get_logger
from bigfleet.operator.kube import MERGE_PATCH, status_code

log = get_logger("bigfleet.operator.events")

NORMAL = "Normal"
WARNING = "Warning"
COMPONENT = "bigfleet-operator"
MAX_MESSAGE = 1024  # the API server truncates longer messages anyway
LRU_SIZE = 4096


@dataclass(frozen=True)
class ObjectRef:
    """The involved object of an Event."""

    api_version: str
    kind: str
    name: str
    namespace: str = ""
    uid: str = ""

    def to_api(self) -> dict[str, str]:
        out = {"apiVersion": self.api_version, "kind": self.kind, "name": self.name}
        if self.namespace:
            out["namespace"] = self.namespace
        if self.uid:
            out["uid"] = self.uid
        return out

    @property
    def event_namespace(self) -> str:
        if self.kind == "Namespace" and self.api_version == "v1":
            return self.name  # (a Namespace's Events live in it)
        return self.namespace or "default"

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.api_version, self.kind, self.namespace, self.name)


@dataclass
class Bucket:
    """A token bucket that refuses instead of waiting. Pure: time is passed in."""

    rate: float
    burst: int
    tokens: float
    last: float

    @classmethod
    def full(cls, rate: float, burst: int, now: float) -> Bucket:
        return cls(rate, burst, float(burst), now)

    def take(self, now: float) -> bool:
        self.tokens = min(float(self.burst), self.tokens + max(0.0, now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass(frozen=True)
class Emit:
    """What to write for one event: a new Event (``update`` False) or a bump of ``name``."""

    update: bool
    name: str
    namespace: str
    count: int
    first_timestamp: str


@dataclass
class _Seen:
    name: str
    namespace: str
    count: int
    first_timestamp: str


@dataclass
class EventCorrelator:
    """Decides, for each event, whether it is dropped, a new object or a count bump. Pure: the
    clock is passed in; names come from ``name_for`` (time-based by default, like client-go)."""

    per_object_burst: int = 25
    per_object_rate: float = 1.0 / 300.0
    qps: float = 10.0
    burst: int = 100
    lru_size: int = LRU_SIZE
    seen: OrderedDict[tuple[Any, ...], _Seen] = field(default_factory=OrderedDict)
    buckets: OrderedDict[tuple[str, str, str, str], Bucket] = field(default_factory=OrderedDict)
    _global: Bucket | None = None

    def decide(self, ref: ObjectRef, etype: str, reason: str, now: float, now_rfc3339: str,
               name_for: Callable[[ObjectRef], str]) -> Emit | None:
        b = self.buckets.get(ref.key)
        if b is None:
            b = self.buckets[ref.key] = Bucket.full(self.per_object_rate, self.per_object_burst, now)
            while len(self.buckets) > self.lru_size:
                self.buckets.popitem(last=False)
        else:
            self.buckets.move_to_end(ref.key)
        if self._global is None:
            self._global = Bucket.full(self.qps, self.burst, now)
        if not b.take(now):
            return None
        if not self._global.take(now):
            b.tokens = min(float(b.burst), b.tokens + 1.0)  # (not this object's fault: give it back)
            return None
        key = (*ref.key, etype, reason)
        s = self.seen.get(key)
        if s is not None:
            s.count += 1
            self.seen.move_to_end(key)
            return Emit(True, s.name, s.namespace, s.count, s.first_timestamp)
        s = _Seen(name_for(ref), ref.event_namespace, 1, now_rfc3339)
        self.seen[key] = s
        while len(self.seen) > self.lru_size:
            self.seen.popitem(last=False)
        return Emit(False, s.name, s.namespace, 1, s.first_timestamp)

    def recreated(self, ref: ObjectRef, etype: str, reason: str, name: str, now_rfc3339: str) -> None:
        """The remembered Event was gone; a new one named ``name`` replaces it (count 1)."""
        key = (*ref.key, etype, reason)
        self.seen[key] = _Seen(name, ref.event_namespace, 1, now_rfc3339)


def rfc3339(t: float | None = None) -> str:
    return dt.datetime.fromtimestamp(time.time() if t is None else t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_name(ref: ObjectRef) -> str:
    """``<object name>.<hex nanoseconds>``, as client-go names Events."""
    return f"{ref.name[:200]}.{time.time_ns():x}"


@dataclass(frozen=True)
class _Pending:
    ref: ObjectRef
    etype: str
    reason: str
    message: str


class EventRecorder:
    """Queues events and writes them (created or bumped) through ``core_api`` (a CoreV1Api)."""

    def __init__(self, core_api: Any, metrics: Any = None, *, identity: str = "", queue_max: int = 10_000,
                 correlator: EventCorrelator | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core_api
        self.metrics = metrics
        self.identity = identity
        self.queue_max = queue_max
        self.correlator = correlator or EventCorrelator()
        self.clock = clock
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.written = 0

    def event(self, ref: ObjectRef, etype: str, reason: str, message: str) -> None:
        """Queue one event; never blocks (dropped and counted when the queue is full)."""
        if self._queue.qsize() >= self.queue_max:
            self._count(reason, "dropped")
            return
        self._queue.put_nowait(_Pending(ref, etype, reason, message[:MAX_MESSAGE]))

    def _count(self, reason: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.events.labels(reason=reason, outcome=outcome).inc()

    async def run(self) -> None:
        while True:
            p = await self._queue.get()
            try:
                await self.write(p.ref, p.etype, p.reason, p.message)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._count(p.reason, "error")
                log.warning("event write failed", reason=p.reason, object=p.ref.name, error=str(exc)[:200])

    async def idle(self) -> None:
        """Wait until every queued event was handled (tests)."""
        while not self._queue.empty():
            await asyncio.sleep(0.01)

    def _body(self, ref: ObjectRef, etype: str, reason: str, message: str, e: Emit, now: str) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": e.name, "namespace": e.namespace},
            "involvedObject": ref.to_api(),
            "reason": reason,
            "message": message,
            "type": etype,
            "count": e.count,
            "firstTimestamp": e.first_timestamp,
            "lastTimestamp": now,
            "source": {"component": COMPONENT},
            "reportingComponent": f"bigfleet.lucy.sh/{COMPONENT}",
            "reportingInstance": self.identity or COMPONENT,
        }

    async def write(self, ref: ObjectRef, etype: str, reason: str, message: str) -> str:
        """Write one event now; returns the outcome (created, updated or dropped)."""
        now = rfc3339()
        e = self.correlator.decide(ref, etype, reason, self.clock(), now, event_name)
        if e is None:
            self._count(reason, "dropped")
            return "dropped"
        if e.update:
            patch = {"count": e.count, "lastTimestamp": now, "message": message}
            try:
                await self.core.patch_namespaced_event(e.name, e.namespace, patch, _content_type=MERGE_PATCH)
                self._count(reason, "updated")
                self.written += 1
                return "updated"
            except Exception as exc:
                if status_code(exc) != 404:
                    raise
            # The Event expired (or was deleted): start a new one.
            name = event_name(ref)
            self.correlator.recreated(ref, etype, reason, name, now)
            e = Emit(False, name, e.namespace, 1, now)
        await self.core.create_namespaced_event(e.namespace, self._body(ref, etype, reason, message, e, now))
        self._count(reason, "created")
        self.written += 1
        return "created"
