"""``bigfleet shard``: one shard replica, served the same way with 1 or 3 replicas.

Without ``--raft-bind`` the shard is a Raft group of one on a loopback port (its own state machine,
journal and snapshot in ``--data-dir``); with it, one member of a replica group. Everything after
the Raft member is built is the same code.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
from collections.abc import Mapping
from pathlib import Path

from structlog.typing import FilteringBoundLogger

from bigfleet.dashboard import DashboardServer
from bigfleet.observability import get_logger, new_registry, start_metrics_server
from bigfleet.raft import RaftSettingsError, timing_problems
from bigfleet.security.limits import SESSION_STREAM_LIMIT
from bigfleet.security.raft import MIN_LENGTH as RAFT_PASSWORD_MIN_LENGTH
from bigfleet.security.roles import SHARD_POLICY, RoleInterceptor
from bigfleet.security.tls import TLSConfig, add_port
from bigfleet.shard.cli import build_server, daemon_config
from bigfleet.shard.config import ShardSettings
from bigfleet.shard.ha.controller import HAController, Heartbeats, register
from bigfleet.shard.ha.node import ShardRaft, ShardRaftConfig
from bigfleet.shard.handoff import LEDGER_FILE
from bigfleet.shard.metrics import ShardMetrics

PASSWORD_ENV = "BIGFLEET_SHARD_RAFT_PASSWORD"
#: the project-wide variable (bigfleet.security.raft): the Helm chart sets this one for every Raft group
SHARED_PASSWORD_ENV = "BIGFLEET_RAFT_PASSWORD"


def raft_password(flag: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The flag, else the shard-specific variable, else the shared one the chart sets."""
    return flag or environ.get(PASSWORD_ENV) or environ.get(SHARED_PASSWORD_ENV, "")


def loopback_address() -> str:
    """A free loopback port for a group of one: no peer ever dials it, and it changes at every start,
    so the member's Raft config keeps its membership out of the log (see `raft_config`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def raft_member(settings: ShardSettings) -> tuple[str, list[str], str] | str:
    """(bind address, peers, password) of this replica's Raft member, or why it cannot start."""
    if not settings.raft_bind:
        # A group of one: nothing but this process can reach the loopback port, so a password
        # nobody knows is as good as a shared one.
        return loopback_address(), [], raft_password(settings.raft_password) or secrets.token_hex(24)
    password = raft_password(settings.raft_password)
    if not password:
        # pysyncobj's transport is pickle: without the password anyone reaching the port runs code.
        return f"a Raft password is required (--raft-password, {PASSWORD_ENV} or {SHARED_PASSWORD_ENV})"
    if len(password) < RAFT_PASSWORD_MIN_LENGTH:
        return f"the Raft password is shorter than {RAFT_PASSWORD_MIN_LENGTH} characters (docs/security.md)"
    peers = [p.strip() for p in (settings.raft_peers or "").split(",") if p.strip()]
    return settings.raft_bind, peers, password


async def serve(settings: ShardSettings, tls: TLSConfig | None = None) -> int:
    replica = settings.replica_id or settings.raft_bind or "single"
    log = get_logger("bigfleet.shard", shard=settings.shard_id, replica=replica)
    member = raft_member(settings)
    if isinstance(member, str):
        log.error(member)
        return 2
    bind, peers, password = member
    data_dir = _data_dir(settings, log)
    if data_dir is None:
        return 1
    epoch_file = data_dir / "epoch"
    registry = new_registry(process_metrics=True)
    metrics = ShardMetrics(registry)
    session_limits = {"/bigfleet.v1alpha1.Shard/Session": SESSION_STREAM_LIMIT}
    server, health = build_server(
        RoleInterceptor(SHARD_POLICY, registry=registry, component="shard", stream_limits=session_limits)
    )
    raft_cfg = raft_config(settings, bind, peers, password, data_dir, log)
    if raft_cfg is None:
        return 2
    try:
        raft = ShardRaft(raft_cfg)
    except RaftSettingsError as exc:  # (e.g. --raft-bind already in use: the replica would join no group)
        log.error("cannot start the Raft member", error=str(exc))
        return 1
    coord_client = None
    heartbeats = None
    if settings.coordinator:
        from bigfleet.coordclient.client import CoordinatorClient

        coord_client = CoordinatorClient([a for a in settings.coordinator.split(",") if a.strip()], tls=tls)
        heartbeats = Heartbeats(coord_client, settings.heartbeat_interval, data_dir / "coordinator-client.json")
    advertise = settings.advertise or settings.listen
    ctrl = HAController(raft, daemon_config(settings, 0), metrics, health, advertise=advertise, tls=tls,
                        registry=registry, epoch_file=epoch_file, heartbeats=heartbeats,
                        legacy_ledger=data_dir / LEDGER_FILE)
    register(server, ctrl)
    try:
        port = add_port(server, settings.listen, tls)
    except OSError as exc:
        log.error("cannot listen", listen=settings.listen, error=str(exc))
        raft.destroy()
        return 1
    await server.start()
    metrics_server = start_metrics_server(settings.metrics_listen, registry) if settings.metrics_listen else None
    dashboard = await _start_dashboard(settings, ctrl, log)
    log.info("shard replica serving", listen=settings.listen, port=port, raft=bind, peers=peers,
             provider=settings.provider, ownership=settings.ownership, paused=settings.paused,
             dry_run=settings.dry_run, dashboard_port=dashboard.port if dashboard is not None else None)
    runner = asyncio.create_task(ctrl.run(), name="shard-leadership")
    await _signalled()
    log.info("shutting down")
    await health.enter_graceful_shutdown()
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    await ctrl.stop()
    await server.stop(grace=2.0)
    if dashboard is not None:
        await dashboard.stop()
    raft.destroy()
    if coord_client is not None:
        await coord_client.close()
    if metrics_server:
        metrics_server.stop()
    log.info("stopped")
    return 0


def _data_dir(settings: ShardSettings, log: FilteringBoundLogger) -> Path | None:
    """The replica's data dir, created if missing; None (logged) when unusable or its epoch file is corrupt."""
    data_dir = Path(settings.data_dir)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.error("cannot use the data dir", data_dir=str(data_dir), error=str(exc))
        return None
    epoch_file = data_dir / "epoch"
    if epoch_file.exists() and not epoch_file.read_text().strip().isdigit():
        # Guessing would risk leading with an epoch a previous incarnation already used.
        log.error("corrupt epoch file; refusing to start", path=str(epoch_file))
        return None
    return data_dir


def raft_config(settings: ShardSettings, bind: str, peers: list[str], password: str, data_dir: Path,
                 log: FilteringBoundLogger) -> ShardRaftConfig | None:
    """The Raft member's settings; None (logged, naming the flags) for timings pysyncobj would refuse."""
    # Bind the Raft port on the named address only (as the coordinator does): pysyncobj would
    # otherwise listen on every interface, and a group of one must stay on loopback.
    raft_cfg = ShardRaftConfig(bind, peers, data_dir, password, bind_address=bind)
    # A group of one on a fresh loopback port is a new Raft address at every start: the membership
    # its snapshot holds (the previous address) must not come back as a peer it waits for.
    raft_cfg.membership_in_log = bool(settings.raft_bind)
    if peers:
        raft_cfg.election_min, raft_cfg.election_max = settings.raft_election_min, settings.raft_election_max
        raft_cfg.leader_fallback = settings.raft_leader_fallback
        # (pysyncobj drops a peer silent this long; the longer elections need a longer allowance)
        raft_cfg.connection_timeout = max(raft_cfg.connection_timeout, settings.raft_election_max)
    problems = timing_problems(raft_cfg, {"election_min": "--raft-election-min", "election_max": "--raft-election-max",
                                          "leader_fallback": "--raft-leader-fallback"})
    if problems:
        log.error("invalid Raft timings: " + "; ".join(problems))
        return None
    return raft_cfg


async def _signalled() -> None:
    """Until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _start_dashboard(settings: ShardSettings, ctrl: HAController, log: FilteringBoundLogger) -> DashboardServer | None:
    """The read-only dashboard on every replica: the leader's data, or a page naming the leader."""
    if not settings.http_listen:
        return None
    from bigfleet.dashboard.sources import ReplicaSource

    source = ReplicaSource(settings.shard_id, lambda: ctrl.dashboard_source, ctrl.leader_hint)
    dashboard = DashboardServer(source, settings.http_listen)
    try:
        await dashboard.start()
    except (OSError, ValueError) as exc:
        log.error("cannot listen for the dashboard", http_listen=settings.http_listen, error=str(exc))
        return None
    return dashboard
