"""``bigfleet shard --raft-bind ...``: one replica of a shard replica group."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bigfleet.observability import get_logger, new_registry, start_metrics_server
from bigfleet.security.limits import SESSION_STREAM_LIMIT
from bigfleet.security.roles import SHARD_POLICY, RoleInterceptor
from bigfleet.security.tls import TLSConfig, add_port
from bigfleet.shard.cli import build_server, daemon_config
from bigfleet.shard.ha.controller import HAController, register
from bigfleet.shard.ha.node import ShardRaft, ShardRaftConfig
from bigfleet.shard.metrics import ShardMetrics

PASSWORD_ENV = "BIGFLEET_SHARD_RAFT_PASSWORD"
#: the project-wide variable (bigfleet.security.raft): the Helm chart sets this one for every Raft group
SHARED_PASSWORD_ENV = "BIGFLEET_RAFT_PASSWORD"


def raft_password(flag: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The flag, else the shard-specific variable, else the shared one the chart sets."""
    return flag or environ.get(PASSWORD_ENV) or environ.get(SHARED_PASSWORD_ENV, "")


async def serve_ha(settings: Any, tls: TLSConfig | None = None) -> int:
    replica = settings.replica_id or settings.raft_bind
    log = get_logger("bigfleet.shard.ha", shard=settings.shard_id, replica=replica)
    password = raft_password(settings.raft_password)
    if not password:
        # pysyncobj's transport is pickle: without the password anyone reaching the port runs code.
        log.error(f"a Raft password is required (--raft-password, {PASSWORD_ENV} or {SHARED_PASSWORD_ENV})")
        return 2
    peers = [p.strip() for p in settings.raft_peers.split(",") if p.strip()]
    registry = new_registry(process_metrics=True)
    metrics = ShardMetrics(registry)
    session_limits = {"/bigfleet.v1alpha1.Shard/Session": SESSION_STREAM_LIMIT}
    server, health = build_server(
        RoleInterceptor(SHARD_POLICY, registry=registry, component="shard", stream_limits=session_limits)
    )
    raft = ShardRaft(ShardRaftConfig(settings.raft_bind, peers, Path(settings.data_dir), password))
    ctrl = HAController(raft, daemon_config(settings, 0), metrics, health,
                        advertise=settings.advertise or settings.listen, tls=tls, registry=registry,
                        epoch_file=Path(settings.data_dir) / "epoch")
    register(server, ctrl)
    coord_client = _wire_heartbeats(settings, ctrl, tls) if settings.coordinator else None
    try:
        port = add_port(server, settings.listen, tls)
    except OSError as exc:
        log.error("cannot listen", listen=settings.listen, error=str(exc))
        raft.destroy()
        return 1
    await server.start()
    metrics_server = start_metrics_server(settings.metrics_listen, registry) if settings.metrics_listen else None
    log.info("shard replica serving", listen=settings.listen, port=port, raft=settings.raft_bind, peers=peers)
    runner = asyncio.create_task(ctrl.run(), name="shard-ha-leadership")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    runner.cancel()
    with contextlib.suppress(BaseException):
        await runner
    await health.enter_graceful_shutdown()
    await ctrl.stop()
    await server.stop(grace=2.0)
    raft.destroy()
    if coord_client is not None:
        await coord_client.close()
    if metrics_server:
        metrics_server.stop()
    log.info("stopped")
    return 0


def _wire_heartbeats(settings: Any, ctrl: HAController, tls: TLSConfig | None) -> Any:
    """Only the leader reports to the coordinator, with its own epoch; a new loop per leadership."""
    from bigfleet.coordclient.client import BaseInstructionHandler, CoordinatorClient, HeartbeatLoop
    from bigfleet.shard.daemon import ShardDaemon

    client = CoordinatorClient([a for a in settings.coordinator.split(",") if a.strip()], tls=tls)
    running: list[asyncio.Task[None]] = []

    def start(daemon: ShardDaemon) -> None:
        hb = HeartbeatLoop(
            client, settings.shard_id, daemon.build_report, BaseInstructionHandler(),
            interval=settings.heartbeat_interval, shard_address=settings.advertise or settings.listen,
            shard_epoch=ctrl.epoch, state_file=Path(settings.data_dir) / "coordinator-client.json",
        )
        daemon.term_source = hb.gate
        running.append(asyncio.get_running_loop().create_task(hb.run(), name="coordinator-heartbeat"))

    async def stop() -> None:
        while running:
            t = running.pop()
            t.cancel()
            await asyncio.gather(t, return_exceptions=True)

    ctrl.on_lead.append(start)
    ctrl.on_step_down.append(stop)
    return client
