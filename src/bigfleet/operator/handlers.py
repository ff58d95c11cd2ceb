"""What the operator does to its cluster: CR acknowledgements, UpcomingNode and AvailableCapacity
writes, and reclaim (cordon, ack, evict honouring PodDisruptionBudgets, report).

Every write is a JSON merge patch or a create; conflicts and transient API
errors are retried. Nothing here runs because the shard went away: these are
reactions to frames the shard sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Callable
from typing import Any

from kubernetes.aio import client

from bigfleet.observability import get_logger
from bigfleet.operator.crds import AVAILABLE_CAPACITIES, CAPACITY_REQUESTS, GROUP, UPCOMING_NODES, VERSION
from bigfleet.operator.events import NORMAL, WARNING, EventRecorder, ObjectRef
from bigfleet.operator.kube import MERGE_PATCH, Informer, status_code, with_retries
from bigfleet.operator.metrics import OperatorMetrics
from bigfleet.operator.upcoming import (
    available_capacity_object,
    plan_upcoming,
    upcoming_name,
    upcoming_object,
)
from bigfleet.v1alpha1 import provider_pb2, shard_pb2

log = get_logger("bigfleet.operator.handlers")
EVICTION_RETRY_SECONDS = 2.0
DEFAULT_GRACE_SECONDS = 30


def rfc3339(t: float | None = None) -> str:
    return dt.datetime.fromtimestamp(time.time() if t is None else t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _conflict_or_transient(exc: BaseException) -> bool:
    code = status_code(exc)
    return code in (409, 429) or (code is not None and code >= 500)


class ClusterWriter:
    """The operator's writes to its own cluster."""

    def __init__(
        self,
        api: client.ApiClient,
        metrics: OperatorMetrics,
        *,
        upcoming_cache: Informer | None = None,
        eviction_retry: float = EVICTION_RETRY_SECONDS,
        events: EventRecorder | None = None,
        node_phase: Callable[[shard_pb2.NodeStateUpdate], str | None] | None = None,
        node_uid: Callable[[str], str] | None = None,
    ) -> None:
        self.api = api
        self.co: Any = client.CustomObjectsApi(api)
        self.core: Any = client.CoreV1Api(api)
        self.metrics = metrics
        self.upcoming_cache = upcoming_cache
        self.eviction_retry = eviction_retry
        self.drains: set[asyncio.Task[bool]] = set()
        self.draining: set[str] = set()  # nodes with a drain task here (a resume skips them)
        # UpcomingNodes deleted after a drain (bounded, oldest forgotten first): see plan_upcoming.
        self.drained_names: dict[str, None] = {}
        self.events = events
        # With node registration tracked: the phase a Configured machine's Node gives it (nodes.py).
        self.node_phase = node_phase
        self.node_uid = node_uid or (lambda _name: "")
        # The newest frame per machine (a Node's change re-plans its machine's UpcomingNode from it).
        self.last_frames: dict[str, shard_pb2.NodeStateUpdate] = {}

    def event(self, ref: ObjectRef, etype: str, reason: str, message: str) -> None:
        if self.events is not None:
            self.events.event(ref, etype, reason, message)

    def _remember_drained(self, name: str) -> None:
        self.drained_names[name] = None
        while len(self.drained_names) > 10_000:
            del self.drained_names[next(iter(self.drained_names))]

    # -- CapacityRequest acknowledgements -------------------------------------------------------
    async def acknowledge(self, keys: list[tuple[str, str]], concurrency: int = 16) -> int:
        """Flip Pending CRs to Acknowledged (merge patch on /status; NotFound counts as done)."""
        if not keys:
            return 0
        sem = asyncio.Semaphore(max(1, concurrency))
        body = {"status": {"phase": "Acknowledged", "acknowledgedAt": rfc3339()}}
        done = 0

        async def one(ns: str, name: str) -> None:
            nonlocal done
            async with sem:
                try:
                    await with_retries(lambda: self.co.patch_namespaced_custom_object_status(
                        GROUP, VERSION, ns, CAPACITY_REQUESTS, name, body, _content_type=MERGE_PATCH),
                        what="acknowledge CapacityRequest")
                    done += 1
                except Exception as exc:
                    if status_code(exc) == 404:
                        return
                    log.warning("acknowledge failed", namespace=ns, name=name, error=str(exc)[:200])

        start = time.perf_counter()
        await asyncio.gather(*(one(ns, n) for ns, n in keys))
        self.metrics.acknowledge_duration.observe(time.perf_counter() - start)
        self.metrics.acknowledged.inc(done)
        return done

    # -- UpcomingNode ---------------------------------------------------------------------------
    async def _get_upcoming(self, name: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = await self.co.get_cluster_custom_object(GROUP, VERSION, UPCOMING_NODES, name)
            return obj
        except Exception as exc:
            if status_code(exc) == 404:
                return None
            raise

    async def apply_node_state(self, u: shard_pb2.NodeStateUpdate) -> str:
        """Create / update / delete ``un-<machine>`` for one frame; returns the resulting phase."""
        start = time.perf_counter()
        phase = "error"
        try:
            phase = await with_retries(lambda: self._apply_node_state_once(u), retry_on=_conflict_or_transient,
                                       what="UpcomingNode write")
            return phase
        finally:
            self.metrics.node_state_duration.labels(phase=phase).observe(time.perf_counter() - start)

    async def _write(self, op: str, fn: Callable[[], Any]) -> Any:
        try:
            out = await fn()
            self.metrics.upcoming_writes.labels(op=op, outcome="success").inc()
            return out
        except Exception as exc:
            outcome = "conflict" if status_code(exc) == 409 else "error"
            self.metrics.upcoming_writes.labels(op=op, outcome=outcome).inc()
            raise

    async def _apply_node_state_once(self, u: shard_pb2.NodeStateUpdate) -> str:
        if not u.machine_id:
            return "ignored"
        name = upcoming_name(u.machine_id)
        current = await self._get_upcoming(name)
        phase = self.node_phase(u) if self.node_phase is not None else None
        plan = plan_upcoming(u, current, rfc3339(), drained=name in self.drained_names, node_phase=phase)
        if plan.delete or plan.phase == "Drained":
            self.last_frames.pop(u.machine_id, None)
        else:
            self.last_frames[u.machine_id] = u
        if int(u.state) != provider_pb2.MACHINE_STATE_IDLE:
            self.drained_names.pop(name, None)
        if plan.delete:
            self._remember_drained(name)
        if plan.create:
            await self._write("create", lambda: self.co.create_cluster_custom_object(
                GROUP, VERSION, UPCOMING_NODES, upcoming_object(plan)))
        elif plan.spec is not None:
            # Maps are replaced wholesale: null out keys that disappeared (merge-patch semantics).
            old = (current or {}).get("spec") or {}
            patch_spec: dict[str, Any] = dict(plan.spec)
            for k in ("labels", "resources"):
                gone = {key: None for key in (old.get(k) or {}) if key not in plan.spec.get(k, {})}
                patch_spec[k] = {**gone, **plan.spec.get(k, {})}
            if "taints" not in plan.spec and "taints" in old:
                patch_spec["taints"] = None
            await self._write("spec_update", lambda: self.co.patch_cluster_custom_object(
                GROUP, VERSION, UPCOMING_NODES, plan.name, {"spec": patch_spec}, _content_type=MERGE_PATCH))
        if plan.status is not None:
            await self._write("status_update", lambda: self.co.patch_cluster_custom_object_status(
                GROUP, VERSION, UPCOMING_NODES, plan.name, {"status": plan.status}, _content_type=MERGE_PATCH))
        if plan.delete:
            with contextlib.suppress(Exception):
                await self._write("delete", lambda: self.co.delete_cluster_custom_object(
                    GROUP, VERSION, UPCOMING_NODES, plan.name))
        return plan.phase

    async def _upcoming_for_node(self, node: str) -> list[str]:
        """Names of UpcomingNodes whose status.nodeRef.name is ``node`` (or, failing that, ``un-<node>``)."""
        if self.upcoming_cache is not None and self.upcoming_cache.synced.is_set():
            items = self.upcoming_cache.items()
        else:
            resp = await self.co.list_cluster_custom_object(GROUP, VERSION, UPCOMING_NODES)
            items = resp.get("items") or []
        out = [o["metadata"]["name"] for o in items
               if (((o.get("status") or {}).get("nodeRef") or {}).get("name")) == node]
        if not out:
            fallback = upcoming_name(node)
            if any(o["metadata"]["name"] == fallback for o in items):
                out.append(fallback)
        return out

    async def _set_upcoming_status(self, names: list[str], status: dict[str, Any], delete: bool = False) -> None:
        for name in names:
            try:
                await with_retries(lambda n=name: self.co.patch_cluster_custom_object_status(  # type: ignore[misc]
                    GROUP, VERSION, UPCOMING_NODES, n, {"status": status}, _content_type=MERGE_PATCH),
                    what="UpcomingNode status")
                if delete:
                    self._remember_drained(name)
                    await self.co.delete_cluster_custom_object(GROUP, VERSION, UPCOMING_NODES, name)
            except Exception as exc:
                if status_code(exc) != 404:
                    log.warning("UpcomingNode status write failed", name=name, error=str(exc)[:200])

    # -- AvailableCapacity ----------------------------------------------------------------------
    async def apply_available_capacity(self, u: shard_pb2.AvailableCapacityUpdate) -> str | None:
        obj = available_capacity_object(u)
        if obj is None:
            return None
        name = obj["metadata"]["name"]

        async def once() -> None:
            try:
                await self.co.create_cluster_custom_object(GROUP, VERSION, AVAILABLE_CAPACITIES, obj)
                return
            except Exception as exc:
                if status_code(exc) != 409:
                    raise
            cur = await self.co.get_cluster_custom_object(GROUP, VERSION, AVAILABLE_CAPACITIES, name)
            if cur.get("spec") == obj["spec"]:
                return
            body = {**obj, "metadata": {**obj["metadata"], "resourceVersion": cur["metadata"]["resourceVersion"]}}
            await self.co.replace_cluster_custom_object(GROUP, VERSION, AVAILABLE_CAPACITIES, name, body)

        await with_retries(once, retry_on=_conflict_or_transient, what="AvailableCapacity write")
        return str(name)

    # -- Reclaim --------------------------------------------------------------------------------
    async def cordon(self, node: str) -> bool:
        """Mark the node unschedulable; False when the node does not exist."""
        try:
            await with_retries(lambda: self.core.patch_node(node, {"spec": {"unschedulable": True}},
                                                            _content_type=MERGE_PATCH), what="cordon")
            return True
        except Exception as exc:
            if status_code(exc) == 404:
                return False
            raise

    async def reclaim(
        self, ins: shard_pb2.ReclaimInstruction, send_ack: Callable[[shard_pb2.ReclaimAck], None]
    ) -> None:
        """Cordon every node, ack at once, then drain in the background (not tied to the stream)."""
        started: list[str] = []
        if ins.preemptor_priority > 0:
            etype, reason = WARNING, "Preempting"
            why = (f"draining within {ins.grace_period_seconds or DEFAULT_GRACE_SECONDS}s: the shard preempts this "
                   f"node for work of priority {ins.preemptor_priority}")
        else:
            etype, reason = NORMAL, "Reclaiming"
            why = (f"draining within {ins.grace_period_seconds or DEFAULT_GRACE_SECONDS}s: this cluster's demand no "
                   f"longer needs the node, the shard takes it back")
        for node in ins.nodes:
            try:
                if await self.cordon(node):
                    started.append(node)
                    self.event(ObjectRef("v1", "Node", node, uid=self.node_uid(node)), etype, reason,
                               f"{why} (instruction {ins.instruction_id}; evictions honour PodDisruptionBudgets)")
                    grace = ins.grace_period_seconds if ins.grace_period_seconds > 0 else DEFAULT_GRACE_SECONDS
                    await self._set_upcoming_status(await self._upcoming_for_node(node), {
                        "phase": "Draining", "drainDeadline": rfc3339(time.time() + grace)})
                else:
                    self.metrics.reclaims.labels(outcome="node_missing").inc()
            except Exception as exc:
                log.warning("cordon failed", node=node, error=str(exc)[:200])
        send_ack(shard_pb2.ReclaimAck(instruction_id=ins.instruction_id, nodes_started=len(started)))
        grace = ins.grace_period_seconds if ins.grace_period_seconds > 0 else DEFAULT_GRACE_SECONDS
        for node in started:
            self._start_drain(node, time.monotonic() + grace, ins.instruction_id)

    def _start_drain(self, node: str, deadline: float, instruction_id: str) -> None:
        self.draining.add(node)
        task = asyncio.create_task(self.drain(node, deadline, instruction_id))
        self.drains.add(task)
        task.add_done_callback(self.drains.discard)
        task.add_done_callback(lambda _t: self.draining.discard(node))

    def resume_drains(self, items: list[dict[str, Any]]) -> list[str]:
        """Drains a previous operator process (or leader) started and did not finish: UpcomingNodes
        still Draining with the deadline this operator recorded. Without this the node stays cordoned
        with its pods until someone notices; resumed, it ends Drained or Failed with the reason."""
        resumed = []
        for o in items:
            st = o.get("status") or {}
            node = ((st.get("nodeRef") or {}).get("name")) or ""
            due = st.get("drainDeadline")
            if st.get("phase") != "Draining" or not node or not due or node in self.draining:
                continue
            try:
                left = dt.datetime.fromisoformat(str(due)).timestamp() - time.time()
            except ValueError:
                left = 0.0  # unreadable: one last pass, then Drained or Failed
            self._start_drain(node, time.monotonic() + max(0.0, left), "resumed")
            resumed.append(node)
            log.info("resuming an interrupted drain", node=node, upcoming=o["metadata"]["name"],
                     seconds_left=round(max(0.0, left), 1))
        return resumed

    async def drain(self, node: str, deadline: float, instruction_id: str = "") -> bool:
        """Evict every non-DaemonSet pod on ``node``; 429 (PDB) is retried until ``deadline``."""
        logger = log.bind(node=node, instruction=instruction_id)
        while True:
            try:
                pods = await with_retries(lambda: self.core.list_pod_for_all_namespaces(
                    field_selector=f"spec.nodeName={node}"), what="list pods on node")
                remaining = [p for p in (pods.items or []) if not _daemonset_or_mirror(p)
                             and ((p.status.phase if p.status else None) or "") not in ("Succeeded", "Failed")]
            except Exception as exc:
                logger.warning("listing pods failed", error=str(exc)[:200])
                remaining = None
            if remaining == []:
                await self._set_upcoming_status(await self._upcoming_for_node(node), {"phase": "Drained"}, delete=True)
                self.metrics.reclaims.labels(outcome="drained").inc()
                logger.info("node drained")
                return True
            if time.monotonic() >= deadline:
                await self._set_upcoming_status(
                    await self._upcoming_for_node(node),
                    {"phase": "Failed", "lastError": f"drain of {node} did not finish within the grace period: "
                     f"{len(remaining or [])} pod(s) left (PodDisruptionBudget)"})
                self.metrics.reclaims.labels(outcome="deadline").inc()
                logger.warning("drain deadline passed", pods_left=len(remaining or []))
                return False
            for p in remaining or []:
                try:
                    await self.core.create_namespaced_pod_eviction(
                        p.metadata.name, p.metadata.namespace,
                        client.V1Eviction(metadata=client.V1ObjectMeta(name=p.metadata.name,
                                                                       namespace=p.metadata.namespace)))
                    self.metrics.evictions.labels(outcome="evicted").inc()
                except Exception as exc:
                    code = status_code(exc)
                    if code == 429:
                        self.metrics.evictions.labels(outcome="blocked").inc()
                    elif code == 404:
                        continue
                    else:
                        self.metrics.evictions.labels(outcome="error").inc()
                        logger.warning("eviction failed", pod=p.metadata.name, error=str(exc)[:200])
            await asyncio.sleep(min(self.eviction_retry, max(0.0, deadline - time.monotonic())))


def _daemonset_or_mirror(pod: Any) -> bool:
    meta = pod.metadata
    if meta is None:
        return False
    if (meta.annotations or {}).get("kubernetes.io/config.mirror"):
        return True
    return any(ref.kind == "DaemonSet" for ref in (meta.owner_references or []))
