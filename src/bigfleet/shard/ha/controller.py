"""Leadership gating for a shard replica group: the imperative shell around :class:`ShardRaft`.

Only the Raft leader acts. On winning an election a replica first commits a ``claim`` (one epoch
bump per Raft term; the commit also proves every earlier entry is applied locally), then builds a
fresh :class:`ShardDaemon` from the replicated roll-ups and carried state, fencing every provider
call with the new epoch. Followers answer ``Session`` and ShardRead with UNAVAILABLE plus the
leader's address in ``bigfleet-redirect`` trailing metadata and report NOT_SERVING. A leader that
loses Raft leadership, or is fenced by the provider (FAILED_PRECONDITION: someone newer acted),
stops its daemon and waits for a later term.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health as grpc_health
from prometheus_client import CollectorRegistry, Counter, Gauge

from bigfleet.decision.types import EngineState
from bigfleet.needs import ValidationError
from bigfleet.observability import get_logger
from bigfleet.rpc.options import NOT_SERVING, SERVING
from bigfleet.shard.daemon import DaemonConfig, ShardDaemon
from bigfleet.shard.ha.node import RaftError, ShardRaft
from bigfleet.shard.ha.state import HAState
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.provider_client import ProviderClient, ProviderError
from bigfleet.shard.store import LocalDemandStore
from bigfleet.v1alpha1 import capacity_pb2, shard_pb2_grpc, shardread_pb2_grpc
from bigfleet.wire.needs import rollup_from_proto

log = get_logger("bigfleet.shard.ha")

REDIRECT_METADATA_KEY = "bigfleet-redirect"  # the key the operator's session client follows
HEALTH_SERVICES = ("", "bigfleet.v1alpha1.Shard")


class FencedProviderClient(ProviderClient):
    """Reports the provider's fencing answer so the controller can step down at once."""

    def __init__(self, *args: Any, on_fenced: Callable[[ProviderError], None], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._on_fenced = on_fenced

    async def _call(self, rpc: str, fn: Any, total: float) -> Any:
        try:
            return await super()._call(rpc, fn, total)
        except ProviderError as exc:
            if exc.fenced:
                self._on_fenced(exc)
            raise


class ReplicatedStore(LocalDemandStore):
    """The leader's in-memory demand store; carried engine state is also written through Raft
    (coalesced: at most one write in flight, the newest state wins)."""

    def __init__(self, raft: ShardRaft, epoch: int) -> None:
        super().__init__()
        self._raft = raft
        self._epoch = epoch
        self._version = 0
        self._pending: EngineState | None = None
        self._writer: asyncio.Task[None] | None = None
        self.engine_writes = 0

    def save_engine_state(self, state: EngineState) -> None:
        super().save_engine_state(state)
        self._pending = self.engine_state()
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_engine())

    async def _write_engine(self) -> None:
        while self._pending is not None:
            st, self._pending = self._pending, None
            self._version += 1
            try:
                await self._raft.save_engine(st, self._version, self._epoch)
                self.engine_writes += 1
            except RaftError as exc:
                log.warning("carried engine state not replicated", error=str(exc))

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(BaseException):
                await self._writer


def restore_store(store: LocalDemandStore, snap: HAState) -> int:
    """Load a new leader's store from the replicated state; returns the number of clusters."""
    for cluster_id, r in sorted(snap.rollups.items()):
        pb = capacity_pb2.ClusterCapacityNeeds.FromString(r.data)
        try:
            _, needs = rollup_from_proto(pb, r.received_unix_nanos)
        except ValidationError as exc:  # it validated when accepted; a schema change is the only way here
            log.error("replicated roll-up no longer decodes; skipped", cluster=cluster_id, error=str(exc))
            continue
        store.apply_rollup(cluster_id, needs, r.received_unix_nanos)
    for c in snap.first_rollup:
        store.mark_first_rollup(c)
    store.save_engine_state(snap.carried())
    return len(snap.rollups)


def read_epoch(path: Path) -> int:
    """The data dir's epoch file (shared format with single-replica mode); missing or corrupt = 0
    (corrupt is logged: the replicated epoch still only moves forward)."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return 0
    if not text.isdigit():
        log.error("corrupt epoch file ignored", path=str(path))
        return 0
    return int(text)


def store_epoch(path: Path, epoch: int) -> None:
    """Record the epoch this replica leads with, atomically, never lowering the stored value."""
    if read_epoch(path) >= epoch:
        return
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(f"{epoch}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _copy_state(s: HAState) -> HAState:
    return HAState(dict(s.rollups), set(s.first_rollup), s.engine, s.engine_version, s.epoch, s.claim_term,
                   s.leader_node, s.leader_advertise, s.replaces)


class HAMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.leader = Gauge("bigfleet_shard_ha_leader", "1 while this replica leads the shard", registry=r)
        self.epoch = Gauge("bigfleet_shard_ha_epoch", "Shard epoch in the replicated state", registry=r)
        self.raft_term = Gauge("bigfleet_shard_ha_raft_term", "Current Raft term", registry=r)
        self.clusters = Gauge("bigfleet_shard_ha_replicated_clusters", "Clusters with a replicated roll-up",
                              registry=r)
        self.replaces = Gauge("bigfleet_shard_ha_replaces_applied", "Replace commands applied locally", registry=r)
        self.takeovers = Counter("bigfleet_shard_ha_takeovers_total", "Times this replica became the leader",
                                 registry=r)
        self.stepdowns = Counter("bigfleet_shard_ha_stepdowns_total", "Times this replica stopped leading",
                                 ["reason"], registry=r)
        self.rollup_commit = Counter("bigfleet_shard_ha_rollups_not_committed", "Roll-ups refused: not committed",
                                   registry=r)


class HAController:
    def __init__(
        self,
        raft: ShardRaft,
        base_config: DaemonConfig,
        metrics: ShardMetrics,
        health: grpc_health.aio.HealthServicer,
        advertise: str,
        tls: Any = None,
        poll: float = 0.05,
        registry: CollectorRegistry | None = None,
        epoch_file: Path | None = None,
    ) -> None:
        self.epoch_file = epoch_file
        # Called with the new daemon after it started / before it stops (e.g. coordinator heartbeats,
        # which must carry the epoch of the term that leads).
        self.on_lead: list[Callable[[ShardDaemon], None]] = []
        self.on_step_down: list[Callable[[], Awaitable[None]]] = []
        self.ha_metrics = HAMetrics(registry)
        self.raft = raft
        self.base_config = base_config
        self.metrics = metrics
        self.health = health
        self.advertise = advertise
        self.tls = tls
        self.poll = poll
        self.daemon: ShardDaemon | None = None
        self.read_servicer: Any = None
        self.admin_servicer: Any = None
        self.epoch = 0
        self.term = -1
        self._fenced_term = -1
        self._stepping_down: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.takeovers = 0
        self.polls = 0

    # -- leadership -----------------------------------------------------------------------------

    async def run(self) -> None:
        await self._set_health(False)
        while not self._stopping.is_set():
            leader = self.raft.is_leader()
            term = self.raft.raft_term()
            self._observe(term)
            if self.daemon is None and leader and term != self._fenced_term:
                try:
                    await self._take_over()
                except Exception:
                    log.exception("takeover failed; will retry")
                    await self._step_down("takeover failed")
            elif self.daemon is not None and (not leader or term != self.term):
                await self._step_down("lost raft leadership")
            self.polls += 1
            await asyncio.sleep(self.poll)

    def _observe(self, term: int) -> None:
        m = self.ha_metrics
        epoch, clusters, replaces = self.raft.read(lambda s: (s.epoch, len(s.rollups), s.replaces))
        m.leader.set(1 if self.daemon is not None else 0)
        m.epoch.set(epoch)
        m.raft_term.set(term)
        m.clusters.set(clusters)
        m.replaces.set(replaces)

    async def _take_over(self) -> None:
        started = time.perf_counter()
        floor = read_epoch(self.epoch_file) if self.epoch_file is not None else 0
        epoch, term = await self.raft.claim(self.advertise, floor)
        if epoch == 0 or not self.raft.is_leader() or self.raft.raft_term() != term:
            log.info("claim refused or leadership moved", term=term)
            return
        if self.epoch_file is not None:
            await asyncio.to_thread(store_epoch, self.epoch_file, epoch)
        snap = self.raft.read(_copy_state)
        self.epoch, self.term = epoch, term
        cfg = replace(self.base_config, epoch=epoch)
        provider = FencedProviderClient(cfg.provider, cfg.shard_id, epoch, self.metrics, tls=self.tls,
                                        on_fenced=self._on_fenced)
        daemon = ShardDaemon(cfg, self.metrics, tls=self.tls, provider=provider)
        store = ReplicatedStore(self.raft, epoch)
        clusters = restore_store(store, snap)
        daemon.store = store
        daemon.before_apply = self._replicate_rollup
        from bigfleet.shard.readsvc import ShardAdminServicer, ShardReadServicer

        self.read_servicer, self.admin_servicer = ShardReadServicer(daemon), ShardAdminServicer(daemon)
        self.daemon = daemon
        self.takeovers += 1
        self.ha_metrics.takeovers.inc()
        await daemon.start()
        for fn in self.on_lead:
            fn(daemon)
        await self._set_health(True)
        log.warning("leading the shard", epoch=epoch, raft_term=term, clusters=clusters,
                    takeover_ms=round((time.perf_counter() - started) * 1000, 1))

    def _on_fenced(self, exc: ProviderError) -> None:
        if self.daemon is None or self._stepping_down is not None:
            return
        log.error("fenced by the provider: a newer epoch acted; stepping down", error=str(exc), epoch=self.epoch)
        self._fenced_term = self.term
        self._stepping_down = asyncio.get_running_loop().create_task(self._step_down("fenced by provider"))

    async def _step_down(self, why: str) -> None:
        d = self.daemon
        if d is None:
            self._stepping_down = None
            return
        self.daemon = None
        self.read_servicer = self.admin_servicer = None
        self.ha_metrics.stepdowns.labels(why).inc()
        await self._set_health(False)
        log.warning("stepping down", reason=why, epoch=self.epoch)
        for hook in self.on_step_down:
            with contextlib.suppress(Exception):
                await hook()
        d.sessions.close_all(grpc.StatusCode.UNAVAILABLE, "shard replica stepped down; reconnect")
        if isinstance(d.store, ReplicatedStore):
            await d.store.close()
        with contextlib.suppress(Exception):
            await d.stop(drain_timeout=1.0)
        self._stepping_down = None

    async def _replicate_rollup(self, cluster_id: str, pb: capacity_pb2.ClusterCapacityNeeds, now: int) -> bool:
        """Commit the roll-up through Raft before the daemon applies and acknowledges it."""
        if self.daemon is None:
            return False
        try:
            ok = await self.raft.replace(cluster_id, pb.SerializeToString(), now, self.epoch)
        except RaftError as exc:
            log.warning("roll-up not committed", cluster=cluster_id, error=str(exc))
            self.ha_metrics.rollup_commit.inc()
            return False
        if not ok:
            log.warning("roll-up refused by the replicated state (stale epoch)", cluster=cluster_id)
        return ok

    async def _set_health(self, serving: bool) -> None:
        for svc in HEALTH_SERVICES:
            await self.health.set(svc, SERVING if serving else NOT_SERVING)

    async def stop(self) -> None:
        self._stopping.set()
        await self._step_down("shutting down")

    # -- follower answers -----------------------------------------------------------------------

    def leader_hint(self) -> str:
        """The leader's advertised address, only when the replicated claim matches Raft's leader."""
        leader = self.raft.leader()
        node, adv = self.raft.read(lambda s: (s.leader_node, s.leader_advertise))
        if leader and leader == node and node != self.raft.address:
            return str(adv)
        return ""

    async def refuse(self, context: grpc.aio.ServicerContext) -> None:
        hint = self.leader_hint()
        # (abort's own trailing_metadata argument: it replaces anything set on the context before)
        await context.abort(grpc.StatusCode.UNAVAILABLE,
                            f"not the shard leader; leader at {hint}" if hint else "not the shard leader; retry",
                            trailing_metadata=((REDIRECT_METADATA_KEY, hint),) if hint else ())


def _forwarder(base: type, ctrl: HAController, attr: str) -> Any:
    """A servicer of ``base``'s shape whose every method runs on the current leader's servicer, or
    refuses with a redirect on a follower."""

    def make(name: str) -> Any:
        async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            impl = getattr(ctrl, attr)
            if impl is None:
                await ctrl.refuse(context)
            return await getattr(impl, name)(request, context)

        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            impl = getattr(ctrl, attr)
            if impl is None:
                await ctrl.refuse(context)
            async for x in getattr(impl, name)(request, context):
                yield x

        return stream if name in _SERVER_STREAMING else unary

    methods = {name: make(name) for name, _ in inspect.getmembers(base, inspect.isfunction)
               if not name.startswith("_")}
    return type(f"HA{base.__name__}", (base,), methods)()


_SERVER_STREAMING = frozenset({"InspectNeeds"})


class HASessionServicer(shard_pb2_grpc.ShardServicer):
    def __init__(self, ctrl: HAController) -> None:
        self.ctrl = ctrl

    async def Session(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:  # type: ignore[override]
        d = self.ctrl.daemon
        if d is None:
            await self.ctrl.refuse(context)
            return
        await d.servicer.Session(request_iterator, context)


def register(server: grpc.aio.Server, ctrl: HAController) -> None:
    shard_pb2_grpc.add_ShardServicer_to_server(HASessionServicer(ctrl), server)
    shardread_pb2_grpc.add_ShardReadServicer_to_server(
        _forwarder(shardread_pb2_grpc.ShardReadServicer, ctrl, "read_servicer"), server)
    shardread_pb2_grpc.add_ShardAdminServicer_to_server(
        _forwarder(shardread_pb2_grpc.ShardAdminServicer, ctrl, "admin_servicer"), server)
