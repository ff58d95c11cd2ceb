"""Leadership of a shard replica: the one place a shard is assembled.

A single-replica shard is a Raft group of one, so this is the only path: only the Raft leader acts.
On winning an election a replica first commits a ``claim`` (one epoch bump per Raft term; the
commit also proves every earlier entry is applied locally), then builds a fresh
:class:`ShardDaemon` from the replicated state (roll-ups, carried engine state, ownership ledger,
actuation), fencing every provider call with the new epoch, and starts its coordinator heartbeats.
Followers answer ``Session``, ShardRead and ShardAdmin with UNAVAILABLE plus the leader's address
in ``bigfleet-redirect`` trailing metadata and report NOT_SERVING; their dashboard names the
leader. A leader that loses Raft leadership, or is fenced by the provider (FAILED_PRECONDITION:
someone newer acted), stops its daemon and waits for a later term.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health as grpc_health
from prometheus_client import CollectorRegistry, Counter, Gauge

from bigfleet.coordclient.client import CoordinatorClient, HeartbeatLoop
from bigfleet.dashboard.model import ActionLog
from bigfleet.dashboard.sources import ShardSource
from bigfleet.observability import get_logger
from bigfleet.rpc.options import NOT_SERVING, SERVING
from bigfleet.security.tls import TLSConfig
from bigfleet.shard.daemon import DaemonConfig, ShardDaemon
from bigfleet.shard.ha.node import ShardLog
from bigfleet.shard.handoff import load_legacy_ledger
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.provider_client import ProviderClient, ProviderError
from bigfleet.shard.providers import build_provider, parse_provider_specs
from bigfleet.shard.readsvc import ShardAdminServicer, ShardReadServicer
from bigfleet.v1alpha1 import shard_pb2_grpc, shardread_pb2_grpc

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


def read_epoch(path: Path) -> int:
    """The data dir's epoch file (the highest epoch this replica led with); missing or corrupt = 0
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


@dataclass
class Heartbeats:
    """How the leader reports to the coordinator (only the leader does, with its term's epoch)."""

    client: CoordinatorClient
    interval: float = 10.0
    state_file: Path | None = None


class HAController:
    """Leadership of one shard replica: builds a :class:`ShardDaemon` for every term it leads."""

    def __init__(
        self,
        raft: ShardLog,
        base_config: DaemonConfig,
        metrics: ShardMetrics,
        health: grpc_health.aio.HealthServicer,
        advertise: str,
        tls: TLSConfig | None = None,
        poll: float = 0.05,
        registry: CollectorRegistry | None = None,
        epoch_file: Path | None = None,
        heartbeats: Heartbeats | None = None,
        legacy_ledger: Path | None = None,
    ) -> None:
        self.epoch_file = epoch_file
        self.heartbeats = heartbeats
        self.legacy_ledger = legacy_ledger
        self.ha_metrics = HAMetrics(registry)
        self.raft = raft
        self.base_config = base_config
        self.metrics = metrics
        self.health = health
        self.advertise = advertise
        self.tls = tls
        self.poll = poll
        self.daemon: ShardDaemon | None = None
        self.read_servicer: ShardReadServicer | None = None
        self.admin_servicer: ShardAdminServicer | None = None
        self.dashboard_source: ShardSource | None = None
        self.epoch = 0
        self.term = -1
        self._fenced_term = -1
        self._heartbeat: asyncio.Task[None] | None = None
        self._stepping_down: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self.takeovers = 0
        self.polls = 0
        self.last_takeover_ms = 0.0

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
        await self._import_legacy_ledger(epoch)
        # --paused/--dry-run as this replica was started: a change since the last leader wins over
        # an older runtime switch; unchanged flags leave a runtime pause or resume in force.
        eng = self.base_config.engine
        await self.raft.apply_actuation_flags(eng.paused, eng.dry_run, epoch)
        self.epoch, self.term = epoch, term
        cfg = replace(self.base_config, epoch=epoch)
        # One provider, or several behind a router (each fenced with this epoch, any one's fencing answer
        # steps this replica down).
        provider = build_provider(parse_provider_specs(cfg.provider), lambda target: FencedProviderClient(
            target, cfg.shard_id, epoch, self.metrics, tls=self.tls, on_fenced=self._on_fenced))
        hb = self.heartbeats
        actions = ActionLog()  # (the dashboard's log of every cycle's actions)
        daemon = ShardDaemon(cfg, self.metrics, tls=self.tls, provider=provider, log=self.raft,
                             coordinator=hb.client if hb is not None else None,
                             cycle_observers=(actions.observe_cycle,))
        self.read_servicer, self.admin_servicer = ShardReadServicer(daemon), ShardAdminServicer(daemon)
        self.dashboard_source = ShardSource(daemon, self.read_servicer, self.admin_servicer, actions, self.advertise)
        self.daemon = daemon
        self.takeovers += 1
        self.ha_metrics.takeovers.inc()
        await daemon.start()
        if hb is not None:
            beat = HeartbeatLoop(hb.client, cfg.shard_id, daemon.build_report, daemon.handoff,
                                 interval=hb.interval, shard_address=self.advertise, shard_epoch=epoch,
                                 state_file=hb.state_file)
            daemon.term_source = beat.gate
            self._heartbeat = asyncio.get_running_loop().create_task(beat.run(), name="coordinator-heartbeat")
        await self._set_health(True)
        self.last_takeover_ms = round((time.perf_counter() - started) * 1000, 1)
        log.warning("leading the shard", epoch=epoch, raft_term=term, clusters=daemon.restored_clusters,
                    takeover_ms=self.last_takeover_ms)

    async def _import_legacy_ledger(self, epoch: int) -> None:
        """A data dir from before the ledger was replicated: its file's releases and adoptions become
        commands once (an empty replicated ledger is the sign nothing was imported yet)."""
        if self.legacy_ledger is None:
            return
        old = await asyncio.to_thread(load_legacy_ledger, self.legacy_ledger)
        if old is None or self.raft.read(
                lambda s: bool(s.ledger.released or s.ledger.adopted or s.ledger.released_clusters)):
            return
        for cid, rc in old.released_clusters.items():
            await self.raft.release_cluster(cid, rc.machines, rc.to_shard, rc.address, epoch, rc.binding_epoch)
        by_why: dict[str, list[str]] = {}
        for mid, why in old.released.items():
            by_why.setdefault(why, []).append(mid)
        for why, ids in by_why.items():
            if why not in old.released_clusters:
                await self.raft.release_machines(tuple(ids), why, epoch)
        if old.adopted:
            await self.raft.adopt(tuple(sorted(old.adopted)), "", epoch)
        log.warning("ownership ledger file imported into the replicated state", path=str(self.legacy_ledger),
                    released=len(old.released), adopted=len(old.adopted))

    def _on_fenced(self, exc: ProviderError) -> None:
        if self.daemon is None or self._stepping_down is not None:
            return
        log.error("fenced by the provider: a newer epoch acted; stepping down", error=str(exc), epoch=self.epoch)
        self._fenced_term = self.term
        self._stepping_down = asyncio.get_running_loop().create_task(self._step_down("fenced by provider"))

    async def _step_down(self, why: str, drain_timeout: float = 1.0,
                         tell_sessions: str = "shard replica stepped down; reconnect") -> None:
        d = self.daemon
        if d is None:
            self._stepping_down = None
            return
        self.daemon = None
        self.read_servicer = self.admin_servicer = None
        self.dashboard_source = None
        self.ha_metrics.stepdowns.labels(why).inc()
        await self._set_health(False)
        log.warning("stepping down", reason=why, epoch=self.epoch)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
            self._heartbeat = None
        d.sessions.close_all(grpc.StatusCode.UNAVAILABLE, tell_sessions)
        await d.store.close()
        try:
            await d.stop(drain_timeout=drain_timeout)
        except Exception:
            log.exception("daemon stop failed while stepping down")
        self._stepping_down = None

    async def _set_health(self, serving: bool) -> None:
        for svc in HEALTH_SERVICES:
            await self.health.set(svc, SERVING if serving else NOT_SERVING)

    async def stop(self) -> None:
        self._stopping.set()
        await self._step_down("shutting down", drain_timeout=5.0, tell_sessions="shard shutting down; reconnect")

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
            # Read the Hello before refusing: an operator that waits for the answer to its Hello
            # then gets the redirect whole, not a local INTERNAL from a write racing our close.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(context.read(), 5.0)
            await self.ctrl.refuse(context)
            return
        await d.servicer.Session(request_iterator, context)


def register(server: grpc.aio.Server, ctrl: HAController) -> None:
    shard_pb2_grpc.add_ShardServicer_to_server(HASessionServicer(ctrl), server)
    shardread_pb2_grpc.add_ShardReadServicer_to_server(
        _forwarder(shardread_pb2_grpc.ShardReadServicer, ctrl, "read_servicer"), server)
    shardread_pb2_grpc.add_ShardAdminServicer_to_server(
        _forwarder(shardread_pb2_grpc.ShardAdminServicer, ctrl, "admin_servicer"), server)
