"""The operator daemon: informers on CapacityRequests, UpcomingNodes and Nodes, the roll-up, the
Session, and (optionally) a Lease so only one replica streams to the shard.

A change to any CapacityRequest schedules a roll-up after a short debounce;
the Session also asks for one on connect and every ``rollup_interval``.
Roll-ups are built from the informer cache (never a fresh LIST), offered to
the one-slot queue, and the CRs still Pending are then acknowledged.

What the shard says back about the demand (``NeedVerdicts``) becomes CapacityRequest status
conditions and Events (``conditions``, ``events``); Nodes decide when an UpcomingNode is Ready and
which machines never joined (``nodes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from kubernetes.aio import client

from bigfleet.observability import get_logger
from bigfleet.operator.bootstrap import BootstrapRenderer
from bigfleet.operator.conditions import plan_status
from bigfleet.operator.crds import API_VERSION, CAPACITY_REQUESTS, GROUP, UPCOMING_NODES, VERSION
from bigfleet.operator.events import WARNING, EventCorrelator, EventRecorder, ObjectRef
from bigfleet.operator.handlers import ClusterWriter, rfc3339
from bigfleet.operator.kube import MERGE_PATCH, Informer, status_code, with_retries
from bigfleet.operator.leader import LeaseElector
from bigfleet.operator.metrics import OperatorMetrics
from bigfleet.operator.nodes import PHASE_JOINING, PHASE_REGISTERED, NodeIndex, due_timeouts
from bigfleet.operator.rollup import MapCache, build_rollup, demand_fingerprint
from bigfleet.operator.session import Backoff, Resolver, SessionClient, StaticResolver
from bigfleet.operator.upcoming import upcoming_name
from bigfleet.operator.whatif import DryRuns
from bigfleet.security.tls import TLSConfig, dial
from bigfleet.v1alpha1 import capacity_pb2, coordinator_pb2, coordinator_pb2_grpc, provider_pb2, shard_pb2

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
    # Disruption budget rules (bigfleet.budget grammar) sent in every roll-up: this cluster's own
    # budget, overriding the shard's defaults.
    disruption_budgets: tuple[str, ...] = ()
    # "on"/"off": this cluster's consolidation switch, overriding the shard's; "" keeps the shard's.
    consolidation: str = ""
    # "node": an UpcomingNode is Ready only once its Node registered and is Ready, and machines whose
    # Node never registers are reported; "provider": Configured is Ready (for clusters whose machines
    # cannot join, e.g. the development stub bootstrap); "auto": "node" unless the stub is in use.
    node_readiness: str = "auto"
    # Seconds a Configured machine may go without a registered Node before it is reported (0: never).
    node_registration_timeout: float = 900.0
    # Seconds after configuration a registered Node may stay NotReady before it is reported (0: never).
    node_ready_timeout: float = 1800.0
    # Values the built-in kubeadm bootstrap template needs (bootstrap.KUBEADM_TEMPLATE).
    api_server_endpoint: str = ""
    ca_cert_hash: str = ""
    # Events per need and verdict frame: a need of 10 000 CRs raises them on at most this many CRs
    # (status conditions are written on every CR).
    events_per_need: int = 10
    # Kubernetes Events written per second by this operator (and burst); per object see events.py.
    events_qps: float = 10.0
    events_burst: int = 100


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

    def failed(self, target: str) -> None:
        """Nothing to forget: a redirect is used once, and every other attempt looks up again."""

    async def lookup(self) -> str | None:
        # A follower coordinator forwards the lookup to its leader. One that does not (no leader
        # reachable from it, or an older release) names the leader in its refusal; that address
        # is tried next, once, when it is dialable from here (a pod name on the coordinator's
        # headless Service is not, from another cluster: then the next address is tried).
        from bigfleet.coordclient.client import leader_hint

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

    def __init__(self, cluster_id: str, writer: ClusterWriter, renderer: BootstrapRenderer,
                 operator: Operator | None = None) -> None:
        self.cluster_id = cluster_id
        self.writer = writer
        self.renderer = renderer
        self.operator = operator

    def need_verdicts(self, frame: shard_pb2.NeedVerdicts) -> None:
        if self.operator is not None and (not frame.cluster_id or frame.cluster_id == self.cluster_id):
            self.operator.on_verdicts(frame)

    def rollup_ack(self, ack: shard_pb2.Acknowledgement) -> None:
        if self.operator is not None:
            self.operator.on_rollup_ack(ack)

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
        self.co: Any = co
        core: Any = client.CoreV1Api(api)
        self.events = EventRecorder(core, self.metrics, identity=cfg.identity or cfg.cluster_id,
                                    correlator=EventCorrelator(qps=cfg.events_qps, burst=cfg.events_burst))
        renderer = BootstrapRenderer(cfg.bootstrap_template, cfg.join_token, api_server_endpoint=cfg.api_server_endpoint,
                                     ca_cert_hash=cfg.ca_cert_hash)
        mode = cfg.node_readiness
        if mode not in ("auto", "node", "provider"):
            raise ValueError(f"node readiness must be auto, node or provider, got {mode!r}")
        self.tracks_nodes = mode == "node" or (mode == "auto" and renderer.joins)
        self.node_index = NodeIndex()
        self.nodes: Informer | None = None
        if self.tracks_nodes:
            self.nodes = Informer("nodes", api, core.list_node, on_change=self._node_changed)
        self.writer = ClusterWriter(api, self.metrics, upcoming_cache=self.upcoming,
                                    eviction_retry=cfg.eviction_retry, events=self.events,
                                    node_phase=self._node_phase if self.tracks_nodes else None,
                                    node_uid=self._node_uid)
        self.handlers = OperatorHandlers(cfg.cluster_id, self.writer, renderer, self)
        resolver: Resolver
        if cfg.coordinators:
            resolver = CoordinatorResolver(cfg.cluster_id, cfg.coordinators, api, cfg.namespace, tls=cfg.tls)
        else:
            resolver = StaticResolver(cfg.shard_addr)
        self.resolver = resolver
        self.session = SessionClient(cfg.cluster_id, resolver, self.handlers, self.metrics,
                                     request_rollup=self.rollup_now, rollup_interval=cfg.rollup_interval,
                                     backoff=backoff, tls=cfg.tls)
        # Dry-run CapacityRequests: answered by the shard's WhatIf into status.whatIf (operator/whatif.py).
        self.dry_runs = DryRuns(cfg.cluster_id, self.crs.items, resolver.resolve, self._write_whatif, tls=cfg.tls)
        self.last_rollup: capacity_pb2.ClusterCapacityNeeds | None = None
        self.map_cache = MapCache()
        # (namespace, name) -> need fingerprint, from the newest roll-up (what NeedVerdicts are keyed on)
        self.cr_fingerprints: dict[tuple[str, str], str] = {}
        self._verdicts: shard_pb2.NeedVerdicts | None = None
        #: the newest frame received: a CapacityRequest that joins a need already decided on gets its
        #: status from it (the shard sends a frame again only when the verdict changes)
        self._last_frame: shard_pb2.NeedVerdicts | None = None
        self._verdicts_due = asyncio.Event()
        # CR status fields this operator wrote and the watch may not have shown yet
        self._written: dict[tuple[str, str], dict[str, Any]] = {}
        self.verdict_frames = 0
        self._prev_needs = 0  # needs of the last roll-up the shard accepted (not held)
        self._hold_flagged = False  # the last "rollup" ack said held: its "rollup-held" echo is the same hold
        self._reported: dict[str, float] = {}  # machine id -> when its registration timeout was last sent
        self._ack_task: asyncio.Task[int] | None = None
        self._last_fp: bytes | None = None
        self.elector: LeaseElector | None = None
        if cfg.leader_elect:
            self.elector = LeaseElector(api, cfg.namespace, cfg.lease_name, cfg.identity or cfg.cluster_id,
                                        lease_duration=cfg.lease_duration, renew_deadline=cfg.renew_deadline,
                                        retry_period=cfg.retry_period)

    def _cr_changed(self, kind: str, obj: dict[str, Any]) -> None:
        self._rollup_due.set()
        self.dry_runs.due.set()

    async def _write_whatif(self, namespace: str, name: str, answer: dict[str, Any] | None) -> None:
        try:
            await with_retries(lambda: self.co.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, CAPACITY_REQUESTS, name, {"status": {"whatIf": answer}},
                _content_type=MERGE_PATCH), what="CapacityRequest what-if")
            self.metrics.status_writes.labels(outcome="success").inc()
        except Exception as exc:
            self.metrics.status_writes.labels(outcome="error").inc()
            if status_code(exc) != 404:
                log.warning("CapacityRequest what-if write failed", namespace=namespace, name=name, error=str(exc)[:200])

    async def rollup_now(self) -> capacity_pb2.ClusterCapacityNeeds:
        """Build a roll-up from the cache, queue it, then acknowledge (in the background) the CRs it included
        for the first time."""
        await self.crs.synced.wait()
        t0 = time.perf_counter()
        items = self.crs.items()
        t1 = time.perf_counter()
        r = build_rollup(self.cfg.cluster_id, items, time.time_ns(), self.map_cache, self.cfg.disruption_budgets,
                         self.cfg.consolidation)
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
        self._map_crs(r.fingerprints)
        self._last_fp = demand_fingerprint(r.message)
        self._start_acks(r.to_acknowledge)
        return r.message

    def _map_crs(self, fingerprints: Mapping[tuple[str, str], str]) -> None:
        """Which need each CapacityRequest is folded into. A CR new to a need the last frame already
        answered gets that answer now: its verdict only changes (and a frame follows) if the demand
        it added changed the decision."""
        new = fingerprints.keys() - self.cr_fingerprints.keys()
        self.cr_fingerprints = dict(fingerprints)
        if new and self._last_frame is not None and self._verdicts is None:
            self._verdicts = self._last_frame
            self._verdicts_due.set()

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
            r = build_rollup(self.cfg.cluster_id, self.crs.items(), time.time_ns(), self.map_cache,
                             self.cfg.disruption_budgets, self.cfg.consolidation)
            if demand_fingerprint(r.message) != self._last_fp:
                try:
                    await self.rollup_now()
                except Exception as exc:
                    log.warning("roll-up failed", error=str(exc)[:300])
            else:  # (the same demand from other CRs, e.g. one replaced by an equal one: map the new ones)
                self._map_crs(r.fingerprints)
                self._start_acks(r.to_acknowledge)

    # -- verdicts → CapacityRequest status and Events ----------------------------------------------

    def on_verdicts(self, frame: shard_pb2.NeedVerdicts) -> None:
        """A NeedVerdicts frame arrived: keep the newest, the status writer picks it up."""
        self._verdicts = self._last_frame = frame
        self._verdicts_due.set()

    async def _verdict_loop(self) -> None:
        while True:
            await self._verdicts_due.wait()
            self._verdicts_due.clear()
            frame, self._verdicts = self._verdicts, None
            if frame is None:
                continue
            await self.crs.synced.wait()
            try:
                await self.apply_verdicts(frame)
            except Exception as exc:
                log.warning("applying need verdicts failed", error=str(exc)[:300])

    def _baseline(self, key: tuple[str, str], obj: dict[str, Any]) -> dict[str, Any]:
        """The CR's status as last known: the cached object's, with what this operator wrote since."""
        status = dict(obj.get("status") or {})
        written = self._written.get(key)
        if written:
            status.update(written)
            for k in [k for k, v in status.items() if v is None]:
                del status[k]
        return status

    async def apply_verdicts(self, frame: shard_pb2.NeedVerdicts) -> int:
        """Write every mapped CR's status from ``frame`` and raise the Events it implies; returns the
        number of status patches written."""
        self.verdict_frames += 1
        self.metrics.verdict_frames.inc()
        by_fp = {v.fingerprint: v for v in frame.verdicts}
        now = rfc3339()
        patches: list[tuple[tuple[str, str], dict[str, Any]]] = []
        events_left: dict[str, int] = {}
        live = set()
        for key in sorted(self.cr_fingerprints):
            fp = self.cr_fingerprints[key]
            v = by_fp.get(fp)
            obj = self.crs.get(*key)
            if v is None or obj is None:
                continue
            live.add(key)
            meta = obj.get("metadata") or {}
            if meta.get("deletionTimestamp"):
                continue
            planned = plan_status(v, frame, int(meta.get("generation") or 0), self._baseline(key, obj), now)
            if planned.status is not None:
                patches.append((key, planned.status))
            left = events_left.setdefault(fp, self.cfg.events_per_need)
            if planned.events and left > 0:
                events_left[fp] = left - 1
                ref = ObjectRef(API_VERSION, "CapacityRequest", key[1], key[0], str(meta.get("uid") or ""))
                for etype, reason, message in planned.events:
                    self.events.event(ref, etype, reason, message)
        for key in [k for k in self._written if k not in live and k not in self.cr_fingerprints]:
            del self._written[key]
        sem = asyncio.Semaphore(max(1, self.cfg.ack_concurrency))

        async def write(key: tuple[str, str], patch: dict[str, Any]) -> None:
            async with sem:
                try:
                    await with_retries(lambda: self.co.patch_namespaced_custom_object_status(
                        GROUP, VERSION, key[0], CAPACITY_REQUESTS, key[1], {"status": patch},
                        _content_type=MERGE_PATCH), what="CapacityRequest conditions")
                    written = self._written.setdefault(key, {})
                    written.update({k: _without_nulls(v) for k, v in patch.items()})
                    self.metrics.status_writes.labels(outcome="success").inc()
                except Exception as exc:
                    self.metrics.status_writes.labels(outcome="error").inc()
                    if status_code(exc) != 404:
                        log.warning("CapacityRequest status write failed", namespace=key[0], name=key[1],
                                    error=str(exc)[:200])

        await asyncio.gather(*(write(k, p) for k, p in patches))
        return len(patches)

    def on_rollup_ack(self, ack: shard_pb2.Acknowledgement) -> None:
        """A roll-up ack: accepted, or held by the shard's empty-roll-up guard (a sudden collapse of
        the demand), which raises a RollupHeld Event (deduplicated: one Event object, its count grows
        with every restatement the guard holds)."""
        now_needs = len(self.last_rollup.needs) if self.last_rollup is not None else 0
        if ack.echo.startswith("rollup-held"):
            # The shard follows a flagged "rollup" ack with this echo: one hold, one Event (a shard
            # that sends only the echo still raises it).
            if self._hold_flagged:
                self._hold_flagged = False
                return
        elif not ack.rollup_held:
            self._hold_flagged = False
            self._prev_needs = now_needs
            return
        else:
            self._hold_flagged = True
        self.events.event(
            ObjectRef("v1", "Namespace", self.cfg.namespace), WARNING, "RollupHeld",
            f"the shard's empty-roll-up guard is holding cluster {self.cfg.cluster_id}'s roll-up: demand fell from "
            f"{self._prev_needs} to {now_needs} need(s) at once. The previous demand stays in force (nothing is "
            f"reclaimed) until the collapse is restated over the guard's hold period; if the drop is a mistake, "
            f"restore the CapacityRequests")

    # -- Nodes: readiness and registration timeouts -------------------------------------------------

    def _node_uid(self, name: str) -> str:
        n = self.node_index.by_name.get(name)
        return str(((n or {}).get("metadata") or {}).get("uid") or "")

    def _node_phase(self, u: shard_pb2.NodeStateUpdate) -> str:
        return self.node_index.phase(u.node_name, u.provider_id)

    def _node_changed(self, kind: str, obj: dict[str, Any]) -> None:
        name = self.node_index.apply(kind, obj)
        if not name:
            return
        pid = str(((obj.get("spec") or {}).get("providerID")) or "")
        for u in list(self.writer.last_frames.values()):
            if int(u.state) != provider_pb2.MACHINE_STATE_CONFIGURED or \
                    not (u.node_name == name or (pid and u.provider_id == pid)):
                continue
            cur = self.upcoming.get("", upcoming_name(u.machine_id))
            if ((cur or {}).get("status") or {}).get("phase") != self._node_phase(u):
                self.session.coalescer.offer(u)  # re-plan the UpcomingNode with the Node's news

    async def _registration_loop(self) -> None:
        timeout = self.cfg.node_registration_timeout
        shortest = min(t for t in (timeout, self.cfg.node_ready_timeout) if t > 0)
        every = min(30.0, max(0.5, shortest / 4))
        resend = max(every, min(60.0, shortest))
        while True:
            await asyncio.sleep(every)
            if self.nodes is None or not self.nodes.synced.is_set() or not self.upcoming.synced.is_set():
                continue
            try:
                self.check_registrations(time.time(), timeout, resend)
            except Exception as exc:
                log.warning("node registration check failed", error=str(exc)[:300])

    def check_registrations(self, now: float, timeout: float, resend: float) -> int:
        """Report every machine Configured for longer than ``timeout`` without a Node (again after
        ``resend`` seconds while it stays so: a report may be lost with its session)."""
        due = due_timeouts(self.upcoming.items(), self.node_index, timeout, now, self.cfg.node_ready_timeout)
        sent = 0
        for t in due:
            if now - self._reported.get(t.machine_id, float("-inf")) < resend:
                continue
            if not self.session.connected.is_set():
                break
            first = t.machine_id not in self._reported
            self._reported[t.machine_id] = now
            ok = self.session.send_response(shard_pb2.OperatorMessage(
                registration_timeout=shard_pb2.NodeRegistrationTimeout(
                    machine_id=t.machine_id, node_name=t.node_name, waited_seconds=t.waited_seconds)))
            sent += ok
            if not first:
                continue  # (a repeat of a report the shard may not have had: no second Event)
            self.metrics.registration_timeouts.inc()
            what = "Ready" if t.registered else "registered"
            limit = self.cfg.node_ready_timeout if t.registered else timeout
            log.warning(f"node not {what} in time; reported to the shard", machine=t.machine_id,
                        node=t.node_name, waited_seconds=t.waited_seconds)
            self.events.event(
                ObjectRef(API_VERSION, "UpcomingNode", t.upcoming_name), WARNING,
                "ReadyTimeout" if t.registered else "RegistrationTimeout",
                f"node {t.node_name or '?'} of machine {t.machine_id} was not {what} within "
                f"{int(limit)}s of the machine being configured (waited {t.waited_seconds}s): the shard stops "
                f"counting it, marks it Failed and provisions a replacement")
        live = {str(((o.get("status") or {}).get("machineID")) or "") for o in self.upcoming.items()
                if ((o.get("status") or {}).get("phase")) in (PHASE_JOINING, PHASE_REGISTERED)}
        for mid in [m for m in self._reported if m not in live]:
            del self._reported[mid]
        return sent

    async def _resume_drains(self) -> None:
        """Once per leadership: finish the drains a previous leader or process left (handlers.py)."""
        await self.upcoming.synced.wait()
        self.writer.resume_drains(self.upcoming.items())

    async def _lead(self) -> None:
        self.metrics.is_leader.set(1)
        try:
            loops = [self.session.run(), self._change_loop(), self._verdict_loop(), self.dry_runs.run(),
                     self._resume_drains()]
            if self.tracks_nodes and (self.cfg.node_registration_timeout > 0 or self.cfg.node_ready_timeout > 0):
                loops.append(self._registration_loop())
            await asyncio.gather(*loops)
        finally:
            self.metrics.is_leader.set(0)

    async def run(self) -> None:
        tasks = [asyncio.create_task(self.crs.run()), asyncio.create_task(self.upcoming.run()),
                 asyncio.create_task(self.events.run())]
        if self.nodes is not None:
            tasks.append(asyncio.create_task(self.nodes.run()))
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


def _without_nulls(v: Any) -> Any:
    """A merge patch's value as it reads once applied (null map entries are deletions)."""
    if isinstance(v, dict):
        return {k: _without_nulls(x) for k, x in v.items() if x is not None}
    return v


def read_file(path: str | None) -> str | None:
    return Path(path).read_text() if path else None
