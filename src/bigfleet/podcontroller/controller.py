"""The pod controller's shell: watch pods, write one CapacityRequest per unschedulable pod.

A CR outlives its pod's scheduling: it is the pod's standing demand, so the
shard does not reclaim the node the pod just landed on. It goes away with
the pod (ownerReference garbage collection) or when the pod turns terminal.
With ``all_pods`` every non-terminal pod gets one (ADR-0039's full-demand mode).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from kubernetes.aio import client
from prometheus_client import CollectorRegistry, Counter, Gauge

from bigfleet.needs import ValidationError
from bigfleet.observability import get_logger
from bigfleet.operator.crds import CAPACITY_REQUESTS, GROUP, VERSION
from bigfleet.operator.kube import MERGE_PATCH, Informer, status_code, with_retries
from bigfleet.podcontroller.derive import (
    OWNED_BY_POD_LABEL,
    PriorityDefaults,
    capacity_request_object,
    is_terminal,
    is_unschedulable,
)

log = get_logger("bigfleet.podcontroller")


class PodControllerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        from bigfleet.observability import new_registry

        self.registry = registry or new_registry()
        self.writes = Counter("bigfleet_podcontroller_capacityrequest_writes_total",
                              "CapacityRequest writes", ["op", "outcome"], registry=self.registry)
        self.skipped = Counter("bigfleet_podcontroller_pods_skipped_total",
                               "Pods whose CapacityRequest could not be derived", registry=self.registry)
        self.leader = Gauge("bigfleet_podcontroller_leader", "1 while this replica runs the controller "
                            "(holds the Lease, or runs without election)", registry=self.registry)


class PodController:
    def __init__(self, api: client.ApiClient, defaults: PriorityDefaults | None = None, *, all_pods: bool = False,
                 metrics: PodControllerMetrics | None = None) -> None:
        self.api = api
        self.metrics = metrics or PodControllerMetrics()
        self.co: Any = client.CustomObjectsApi(api)
        self.defaults: PriorityDefaults = defaults or {}
        self.all_pods = all_pods
        self.queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self.queued: set[tuple[str, str]] = set()
        self.pods = Informer("pods", api, client.CoreV1Api(api).list_pod_for_all_namespaces, on_change=self._pod_event)
        self.crs = Informer("capacityrequests", api, self.co.list_cluster_custom_object, GROUP, VERSION,
                            CAPACITY_REQUESTS, label_selector=OWNED_BY_POD_LABEL)
        self.created = 0
        self.deleted = 0
        self._recent: dict[str, int] = {}  # pod uid -> CRs created, until the CR informer sees them

    def _pod_event(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        if not meta.get("name"):
            return
        key = (str(meta.get("namespace") or ""), str(meta["name"]))
        if key not in self.queued:
            self.queued.add(key)
            self.queue.put_nowait(key)

    def _crs_for(self, uid: str) -> list[Mapping[str, Any]]:
        return [o for o in self.crs.items() if ((o.get("metadata") or {}).get("labels") or {}).get(OWNED_BY_POD_LABEL) == uid]

    async def reconcile(self, namespace: str, name: str) -> None:
        pod = self.pods.get(namespace, name)
        if pod is None:
            return  # deleted: its CRs are garbage-collected through the ownerReference
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        existing = self._crs_for(uid)
        if is_terminal(pod):
            for o in existing:
                try:
                    await self.co.delete_namespaced_custom_object(GROUP, VERSION, namespace, CAPACITY_REQUESTS,
                                                                  o["metadata"]["name"])
                    self.deleted += 1
                    self.metrics.writes.labels(op="delete", outcome="success").inc()
                except Exception as exc:
                    if status_code(exc) != 404:
                        self.metrics.writes.labels(op="delete", outcome="error").inc()
                        raise
            return
        if existing or uid in self._recent:
            return
        if not (self.all_pods or is_unschedulable(pod)):
            return
        try:
            body = capacity_request_object(pod, self.defaults)
        except ValidationError as exc:
            log.warning("pod skipped", namespace=namespace, pod=name, reason=str(exc))
            self.metrics.skipped.inc()
            return
        try:
            created = await with_retries(lambda: self.co.create_namespaced_custom_object(
                GROUP, VERSION, namespace, CAPACITY_REQUESTS, body), what="create CapacityRequest")
        except Exception:
            self.metrics.writes.labels(op="create", outcome="error").inc()
            raise
        self.metrics.writes.labels(op="create", outcome="success").inc()
        self._recent[uid] = 1
        self.created += 1
        try:
            await self.co.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, CAPACITY_REQUESTS, created["metadata"]["name"],
                {"status": {"phase": "Pending"}}, _content_type=MERGE_PATCH)
        except Exception as exc:  # not fatal: the operator treats a missing phase as Pending
            log.info("setting phase Pending failed", error=str(exc)[:200])

    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            self.queued.discard(key)
            try:
                await self.reconcile(*key)
            except Exception as exc:
                log.warning("reconcile failed; requeued", namespace=key[0], pod=key[1], error=str(exc)[:200])
                await asyncio.sleep(0.5)
                self._pod_event("RETRY", {"metadata": {"namespace": key[0], "name": key[1]}})
            # forget uids the CR informer has caught up with
            for uid in [u for u in self._recent if self._crs_for(u)]:
                del self._recent[uid]

    async def run(self) -> None:
        tasks = [asyncio.create_task(self.crs.run())]
        await self.crs.synced.wait()
        tasks.append(asyncio.create_task(self.pods.run()))
        tasks += [asyncio.create_task(self._worker()) for _ in range(4)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
