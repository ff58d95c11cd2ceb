"""The operator daemon: informers on CapacityRequests and UpcomingNodes, the roll-up, the Session,
and (optionally) a Lease so only one replica streams to the shard.

A change to any CapacityRequest schedules a roll-up after a short debounce;
the Session also asks for one on connect and every ``rollup_interval``.
Roll-ups are built from the informer cache (never a fresh LIST), offered to
the one-slot queue, and the CRs still Pending are then acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from kubernetes.aio import client

from bigfleet.observability import get_logger
from bigfleet.operator.bootstrap import BootstrapRenderer
from bigfleet.operator.crds import CAPACITY_REQUESTS, GROUP, UPCOMING_NODES, VERSION
from bigfleet.operator.handlers import ClusterWriter
from bigfleet.operator.kube import Informer, status_code
from bigfleet.operator.leader import LeaseElector
from bigfleet.operator.metrics import OperatorMetrics
from bigfleet.operator.rollup import MapCache, build_rollup, demand_fingerprint
from bigfleet.operator.session import Backoff, Resolver, SessionClient, StaticResolver
from bigfleet.security.tls import TLSConfig, dial
from bigfleet.v1alpha1 import capacity_pb2, coordinator_pb2, coordinator_pb2_grpc, shard_pb2

log = get_logger("bigfleet.operator")
SHARD_CACHE_CONFIGMAP = "bigfleet-operator-shard"


@dataclass
class OperatorConfig:
    cluster_id: str
    shard_addr: str = ""
    coordinators: tuple[str, ...] = ()
    namespace: str = "bigfleet-system"
    rollup_interval: float = 10.0
    debounce: float = 0.2
    ack_concurrency: int = 16
    bootstrap_template: str | None = None
    join_token: str = ""
    leader_elect: bool = False
    lease_name: str = "bigfleet-operator"
    identity: str = ""
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0
    eviction_retry: float = 2.0
    tls: TLSConfig | None = None


class CoordinatorResolver:
    """Find this cluster's shard through ``Coordinator.LookupCluster``, caching the answer in a ConfigMap.

    With every coordinator unreachable the cached address is used, so the operator keeps working
    while the coordinator is down. A redirect from a shard overrides the answer once.
    """

    def __init__(self, cluster_id: str, coordinators: tuple[str, ...], api: client.ApiClient, namespace: str,
                 timeout: float = 5.0, tls: TLSConfig | None = None) -> None:
        self.cluster_id = cluster_id
        self.tls = tls
        self.coordinators = coordinators
        self.core: Any = client.CoreV1Api(api)
        self.namespace = namespace
        self.timeout = timeout
        self._override: str | None = None
        self.cached: str | None = None

    def redirect(self, target: str) -> None:
        self._override = target

    async def lookup(self) -> str | None:
        # A follower coordinator forwards the lookup to its leader. One that does not (no leader
        # reachable from it, or an older release) names the leader in its refusal; that address
        # is tried next, once, when it is dialable from here (a pod name on the coordinator's
        # headless Service is not, from another cluster: then the next address is tried).
        from bigfleet.coordinator.client import leader_hint

        order, tried = list(self.coordinators), set()
        while order:
            addr = order.pop(0)
            if addr in tried:
                continue
            tried.add(addr)
            try:
                async with dial(addr, self.tls) as ch:
                    stub = coordinator_pb2_grpc.CoordinatorStub(ch)
                    resp = await stub.LookupCluster(coordinator_pb2.LookupClusterRequest(cluster_id=self.cluster_id),
                                                    timeout=self.timeout)
                if resp.shard_address:
                    return str(resp.shard_address)
            except grpc.aio.AioRpcError as exc:
                hint = leader_hint(exc) if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else ""
                log.info("coordinator lookup failed", coordinator=addr, code=exc.code().name, leader=hint)
                if hint and hint not in tried:
                    order.insert(0, hint)
        return None

    async def _read_cache(self) -> str | None:
        try:
            cm = await self.core.read_namespaced_config_map(SHARD_CACHE_CONFIGMAP, self.namespace)
            return (cm.data or {}).get("shardAddress") or None
        except Exception as exc:
            if status_code(exc) != 404:
                log.warning("reading the shard cache failed", error=str(exc)[:200])
            return None

    async def _write_cache(self, addr: str) -> None:
        body = client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name=SHARD_CACHE_CONFIGMAP, namespace=self.namespace),
            data={"shardAddress": addr, "clusterID": self.cluster_id},
        )
        try:
            await self.core.create_namespaced_config_map(self.namespace, body)
        except Exception as exc:
            if status_code(exc) != 409:
                raise
            await self.core.replace_namespaced_config_map(SHARD_CACHE_CONFIGMAP, self.namespace, body)

    async def resolve(self) -> str:
        if self._override:
            target, self._override = self._override, None
            return target
        addr = await self.lookup()
        if addr:
            if addr != self.cached:
                try:
                    await self._write_cache(addr)
                except Exception as exc:
                    log.warning("caching the shard address failed", error=str(exc)[:200])
            self.cached = addr
            return addr
        cached = self.cached or await self._read_cache()
        if cached:
            log.info("coordinator unreachable; using the cached shard", shard=cached)
            self.cached = cached
            return cached
        raise ConnectionError("no coordinator answered and no shard address is cached")


class OperatorHandlers:
    """Binds shard frames to the cluster writer and the bootstrap renderer."""

    def __init__(self, cluster_id: str, writer: ClusterWriter, renderer: BootstrapRenderer) -> None:
        self.cluster_id = cluster_id
        self.writer = writer
        self.renderer = renderer

    def bootstrap(self, req: shard_pb2.BootstrapRequest) -> shard_pb2.BootstrapBlobResponse:
        return self.renderer.render(req, self.cluster_id)

    async def node_state(self, u: shard_pb2.NodeStateUpdate) -> None:
        await self.writer.apply_node_state(u)

    async def available_capacity(self, u: shard_pb2.AvailableCapacityUpdate) -> None:
        await self.writer.apply_available_capacity(u)

    async def reclaim(self, ins: shard_pb2.ReclaimInstruction, send_ack: Any) -> None:
        await self.writer.reclaim(ins, send_ack)


class Operator:
    def __init__(self, cfg: OperatorConfig, api: client.ApiClient, metrics: OperatorMetrics | None = None,
                 *, backoff: Backoff | None = None) -> None:
        self.cfg = cfg
        self.api = api
        self.metrics = metrics or OperatorMetrics()
        co = client.CustomObjectsApi(api)
        self._rollup_due = asyncio.Event()
        self.crs = Informer("capacityrequests", api, co.list_cluster_custom_object, GROUP, VERSION,
                            CAPACITY_REQUESTS, on_change=self._cr_changed)
        self.upcoming = Informer("upcomingnodes", api, co.list_cluster_custom_object, GROUP, VERSION, UPCOMING_NODES)
        self.writer = ClusterWriter(api, self.metrics, upcoming_cache=self.upcoming,
                                    eviction_retry=cfg.eviction_retry)
        renderer = BootstrapRenderer(cfg.bootstrap_template, cfg.join_token)
        self.handlers = OperatorHandlers(cfg.cluster_id, self.writer, renderer)
        resolver: Resolver
        if cfg.coordinators:
            resolver = CoordinatorResolver(cfg.cluster_id, cfg.coordinators, api, cfg.namespace, tls=cfg.tls)
        else:
            resolver = StaticResolver(cfg.shard_addr)
        self.resolver = resolver
        self.session = SessionClient(cfg.cluster_id, resolver, self.handlers, self.metrics,
                                     request_rollup=self.rollup_now, rollup_interval=cfg.rollup_interval,
                                     backoff=backoff, tls=cfg.tls)
        self.last_rollup: capacity_pb2.ClusterCapacityNeeds | None = None
        self.map_cache = MapCache()
        self._ack_task: asyncio.Task[int] | None = None
        self._last_fp: bytes | None = None
        self.elector: LeaseElector | None = None
        if cfg.leader_elect:
            self.elector = LeaseElector(api, cfg.namespace, cfg.lease_name, cfg.identity or cfg.cluster_id,
                                        lease_duration=cfg.lease_duration, renew_deadline=cfg.renew_deadline,
                                        retry_period=cfg.retry_period)

    def _cr_changed(self, kind: str, obj: dict[str, Any]) -> None:
        self._rollup_due.set()

    async def rollup_now(self) -> capacity_pb2.ClusterCapacityNeeds:
        """Build a roll-up from the cache, queue it, then acknowledge (in the background) the CRs it included
        for the first time."""
        await self.crs.synced.wait()
        t0 = time.perf_counter()
        items = self.crs.items()
        t1 = time.perf_counter()
        r = build_rollup(self.cfg.cluster_id, items, time.time_ns(), self.map_cache)
        t2 = time.perf_counter()
        self.session.offer_rollup(r.message)
        t3 = time.perf_counter()
        m = self.metrics
        m.rollup_phase_duration.labels(phase="list").observe(t1 - t0)
        m.rollup_phase_duration.labels(phase="build").observe(t2 - t1)
        m.rollup_phase_duration.labels(phase="enqueue").observe(t3 - t2)
        m.rollup_duration.observe(t3 - t0)
        m.rollup_needs.set(len(r.message.needs))
        m.crs_skipped.set(len(r.skipped))
        for s in r.skipped:
            log.warning("CapacityRequest skipped", namespace=s.namespace, name=s.name, reason=s.reason)
        self.last_rollup = r.message
        self._last_fp = demand_fingerprint(r.message)
        self._start_acks(r.to_acknowledge)
        return r.message

    def _start_acks(self, keys: tuple[tuple[str, str], ...]) -> None:
        """Acknowledge in the background (one batch at a time) so a burst of new CRs never delays roll-ups."""
        if not keys or (self._ack_task is not None and not self._ack_task.done()):
            return
        self._ack_task = asyncio.create_task(self.writer.acknowledge(list(keys), self.cfg.ack_concurrency))

    async def _change_loop(self) -> None:
        """Roll up soon after CapacityRequests change (debounced), only when the demand differs."""
        while True:
            await self._rollup_due.wait()
            await asyncio.sleep(self.cfg.debounce)
            self._rollup_due.clear()
            if not self.session.connected.is_set() or not self.crs.synced.is_set():
                continue
            r = build_rollup(self.cfg.cluster_id, self.crs.items(), time.time_ns(), self.map_cache)
            if demand_fingerprint(r.message) != self._last_fp:
                try:
                    await self.rollup_now()
                except Exception as exc:
                    log.warning("roll-up failed", error=str(exc)[:300])
            else:
                self._start_acks(r.to_acknowledge)

    async def _lead(self) -> None:
        self.metrics.is_leader.set(1)
        try:
            await asyncio.gather(self.session.run(), self._change_loop())
        finally:
            self.metrics.is_leader.set(0)

    async def run(self) -> None:
        tasks = [asyncio.create_task(self.crs.run()), asyncio.create_task(self.upcoming.run())]
        try:
            if self.elector is not None:
                await self.elector.run(self._lead)
            else:
                await self._lead()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._ack_task is not None:
                self._ack_task.cancel()
            with contextlib.suppress(Exception):
                await self.session.drain_handlers()


def read_file(path: str | None) -> str | None:
    return Path(path).read_text() if path else None
