"""`bigfleet shard`: run one shard process."""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import sys
from typing import Any

import grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2_grpc

from bigfleet.observability import configure_logging, get_logger, new_registry, start_metrics_server
from bigfleet.rpc.options import NOT_SERVING, SERVING, server_options
from bigfleet.security.limits import SESSION_STREAM_LIMIT
from bigfleet.security.roles import SHARD_POLICY, RoleInterceptor
from bigfleet.security.tls import TLSConfig, add_port, add_tls_arguments, tls_from_args_or_exit
from bigfleet.v1alpha1 import shard_pb2_grpc, shardread_pb2_grpc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bigfleet shard", description="Run a shard: sessions, cycles, provider execution.")
    p.add_argument("--config", help="YAML file with settings (flag names, dashes or underscores)")
    p.add_argument("--shard-id")
    p.add_argument("--listen", help="HOST:PORT for Shard, ShardRead and ShardAdmin")
    p.add_argument("--provider", help="HOST:PORT of the capacity provider")
    p.add_argument("--metrics-listen", help="HOST:PORT for /metrics (empty = off)")
    p.add_argument("--http-listen", help="HOST:PORT for the read-only dashboard and its JSON (empty = off)")
    p.add_argument("--coordinator", help="coordinator addresses HOST:PORT,...")
    p.add_argument("--advertise", help="address operators dial (defaults to --listen)")
    p.add_argument("--data-dir", help="holds the epoch file")
    p.add_argument("--heartbeat-interval", type=float, help="seconds between coordinator reports")
    p.add_argument("--ownership", choices=["exclusive", "shared"],
                   help="exclusive: every provider machine not handed away is ours (default); shared: only "
                        "machines adopted from another shard on the same provider")
    p.add_argument("--cycle-interval", type=float)
    p.add_argument("--min-cycle-gap", type=float)
    p.add_argument("--bootstrap-timeout", type=float)
    p.add_argument("--execute-timeout", type=float)
    p.add_argument("--execute-concurrency", type=int)
    p.add_argument("--reconcile-interval", type=float)
    p.add_argument("--available-capacity-interval", type=float)
    p.add_argument("--available-capacity-rate", type=float,
                   help="AvailableCapacityUpdate frames written per second, shard-wide (0: unpaced)")
    p.add_argument("--reclaim-cap-fraction", type=float)
    p.add_argument("--on-demand-hold-seconds", type=int, help="idle on-demand release hold (<= 0: never)")
    p.add_argument("--spot-hold-seconds", type=int, help="idle spot release hold (<= 0: never)")
    p.add_argument("--no-empty-rollup-guard", dest="empty_rollup_guard", action="store_const", const=False)
    p.add_argument("--dry-run", action="store_const", const=True)
    p.add_argument("--engine-mode", choices=["worker", "thread", "inline", "fork"],
                   help="where the decision engine runs: worker (default: a long-lived process fed deltas), "
                        "thread, inline (on the event loop), fork (a forked child per cycle)")
    p.add_argument("--engine-timeout", type=float, help="seconds before a silent engine worker is replaced")
    p.add_argument("--engine-nice", type=int, help="niceness added to the engine worker (0-19; sessions win the CPU)")
    p.add_argument("--engine-fork", action="store_const", const=True, help="same as --engine-mode fork")
    p.add_argument("--paused", action="store_const", const=True)
    ha = p.add_argument_group("replica group (shard HA, off unless --raft-bind is given)")
    ha.add_argument("--replica-id", help="this replica's name (logs, metrics)")
    ha.add_argument("--raft-bind", help="HOST:PORT of this replica's Raft endpoint (also its Raft identity)")
    ha.add_argument("--raft-peers", help="Raft endpoints of the other replicas HOST:PORT,...")
    ha.add_argument("--raft-password", help="shared Raft transport secret (prefer BIGFLEET_SHARD_RAFT_PASSWORD)")
    add_tls_arguments(p)
    p.add_argument("--log-level")
    p.add_argument("--log-format", choices=["json", "console"])
    return p


# Operators keep one stream open for days and send keepalive pings (every 20 s with the shared
# channel options). gRPC servers by default allow a ping without data only every 5 minutes and
# answer more with GOAWAY "too_many_pings", which would drop every idle session.
# The pending-request limits: gRPC's core parks calls the application has not picked up yet and
# cancels them beyond 1 000 parked (3 000 hard). A Python server picks them up one at a time, so
# when thousands of operators reconnect at once (a shard restart) about a quarter of the streams
# were cancelled and retried (tests/shard/test_session_burst.py). Calls also wait at most 30 s to
# be picked up by default; at 500 000 machines a shard replaying every new session's machines took
# longer than that and 74-1 098 of 5 000 opens were cancelled (none with 300 s).
SESSION_SERVER_OPTIONS = [
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_concurrent_streams", 100_000),
    ("grpc.server.max_pending_requests", 20_000),
    ("grpc.server.max_pending_requests_hard_limit", 40_000),
    ("grpc.server_max_unrequested_time_in_server", 300),
]


def build_server(*interceptors: grpc.aio.ServerInterceptor) -> tuple[grpc.aio.Server, grpc_health.aio.HealthServicer]:
    server = grpc.aio.server(options=server_options(SESSION_SERVER_OPTIONS), interceptors=list(interceptors))
    health = grpc_health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    return server, health


def main(argv: list[str]) -> int:
    from bigfleet.shard.config import load_settings

    parser = build_parser()
    ns = parser.parse_args(argv)
    tls = tls_from_args_or_exit(parser, ns)
    args = vars(ns)
    for k in [k for k in args if k.startswith("tls_")]:
        args.pop(k)
    config_file = args.pop("config")
    try:
        settings = load_settings(config_file, args)
    except Exception as exc:
        print(f"bigfleet shard: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if not settings.provider:
        print("bigfleet shard: --provider HOST:PORT is required", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format, component="shard")  # type: ignore[arg-type]
    # The engine runs on a worker thread; a short GIL switch interval lets the event loop (and
    # gRPC's poller) get back in quickly, which is what bounds roll-up latency while cycles run.
    sys.setswitchinterval(settings.gil_switch_interval)
    # The collector's defaults (700, 10, 10) make a shard with thousands of sessions run ~80 young
    # and several full collections a second, each a pause for every session on the loop (measured
    # at 5 000 sessions: up to 128 ms in every generation). Survivors are frozen every second and
    # after each cycle (daemon._settle_heap) and unfrozen for one full collection every 10 minutes,
    # so young collections stay small and a full one comes only every 1 000 middle ones.
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        return asyncio.run(serve(settings, tls))
    except KeyboardInterrupt:
        return 0


#: gc.set_threshold for a shard process (see main)
GC_THRESHOLDS = (20_000, 20, 1_000)


async def serve(settings: Any, tls: TLSConfig | None = None) -> int:
    from bigfleet.shard.daemon import ShardDaemon
    from bigfleet.shard.epoch import EpochError, bump_epoch
    from bigfleet.shard.metrics import ShardMetrics
    from bigfleet.shard.readsvc import ShardAdminServicer, ShardReadServicer

    if settings.raft_bind:
        from bigfleet.shard.ha.serve import serve_ha

        return await serve_ha(settings, tls)
    log = get_logger("bigfleet.shard.cli", shard=settings.shard_id)
    try:
        epoch = bump_epoch(settings.data_dir)
    except (EpochError, OSError) as exc:
        log.error("cannot establish the shard epoch", error=str(exc))
        return 1
    registry = new_registry(process_metrics=True)
    metrics = ShardMetrics(registry)
    cfg = daemon_config(settings, epoch)
    daemon = ShardDaemon(cfg, metrics, tls=tls)
    from pathlib import Path

    from bigfleet.shard.handoff import ShardHandoff

    # Installed before the first reconcile: a released machine must never be re-read as ours.
    handoff = ShardHandoff(daemon, Path(settings.data_dir), mode=settings.ownership)
    # Per-session flood control and frame size bounds (roll-ups paced, floods/oversize closed).
    session_limits = {"/bigfleet.v1alpha1.Shard/Session": SESSION_STREAM_LIMIT}
    server, health = build_server(
        RoleInterceptor(SHARD_POLICY, registry=registry, component="shard", stream_limits=session_limits)
    )
    shard_pb2_grpc.add_ShardServicer_to_server(daemon.servicer, server)
    shardread_pb2_grpc.add_ShardReadServicer_to_server(ShardReadServicer(daemon), server)
    shardread_pb2_grpc.add_ShardAdminServicer_to_server(ShardAdminServicer(daemon), server)
    try:
        port = add_port(server, settings.listen, tls)
    except OSError as exc:
        log.error("cannot listen", listen=settings.listen, error=str(exc))
        return 1
    await server.start()
    metrics_server = start_metrics_server(settings.metrics_listen, registry) if settings.metrics_listen else None
    await health.set("", SERVING)
    await health.set("bigfleet.v1alpha1.Shard", SERVING)
    heartbeat_task: asyncio.Task[None] | None = None
    coord_client = None
    if settings.coordinator:
        from bigfleet.coordclient.client import CoordinatorClient, HeartbeatLoop

        coord_client = CoordinatorClient(
            [a for a in settings.coordinator.split(",") if a.strip()],
            tls=tls,
        )
        handoff.coordinator = coord_client  # the handoff-window hold asks it about unknown clusters
        heartbeat = HeartbeatLoop(
            coord_client, settings.shard_id, daemon.build_report, handoff,
            interval=settings.heartbeat_interval, shard_address=settings.advertise or settings.listen,
            shard_epoch=epoch, state_file=Path(settings.data_dir) / "coordinator-client.json",
        )
        daemon.term_source = heartbeat.gate
        heartbeat_task = asyncio.create_task(heartbeat.run(), name="coordinator-heartbeat")
        log.info("reporting to the coordinator", coordinator=settings.coordinator,
                 interval=settings.heartbeat_interval)
    log.info("shard serving", listen=settings.listen, port=port, provider=settings.provider, epoch=epoch,
             paused=settings.paused, dry_run=settings.dry_run)
    await daemon.start()
    dashboard = None
    if settings.http_listen:
        from bigfleet.dashboard import DashboardServer
        from bigfleet.dashboard.sources import ShardSource

        dashboard = DashboardServer(ShardSource(daemon, settings.advertise or settings.listen), settings.http_listen)
        try:
            await dashboard.start()
        except (OSError, ValueError) as exc:
            log.error("cannot listen for the dashboard", http_listen=settings.http_listen, error=str(exc))
            dashboard = None

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    await health.enter_graceful_shutdown()
    await health.set("", NOT_SERVING)
    if heartbeat_task is not None:
        heartbeat_task.cancel()
        await asyncio.gather(heartbeat_task, return_exceptions=True)
    if coord_client is not None:
        await coord_client.close()
    await daemon.stop(drain_timeout=5.0)
    await server.stop(grace=3.0)
    if dashboard is not None:
        await dashboard.stop()
    if metrics_server:
        metrics_server.stop()
    log.info("stopped")
    return 0


def daemon_config(settings: Any, epoch: int) -> Any:
    """The daemon's configuration from settings (shared with the HA entry point)."""
    from bigfleet.decision.types import EngineConfig
    from bigfleet.shard.daemon import DaemonConfig
    from bigfleet.shard.executor import ExecutorConfig
    from bigfleet.shard.guard import GuardConfig

    return DaemonConfig(
        shard_id=settings.shard_id,
        provider=settings.provider,
        epoch=epoch,
        cycle_interval=settings.cycle_interval,
        min_cycle_gap=settings.min_cycle_gap,
        reconcile_interval=settings.reconcile_interval,
        full_reconcile_every=settings.full_reconcile_every,
        available_capacity_interval=settings.available_capacity_interval,
        available_capacity_rate=settings.available_capacity_rate,
        executor=ExecutorConfig(
            concurrency=settings.execute_concurrency,
            execute_timeout=settings.execute_timeout,
            bootstrap_timeout=settings.bootstrap_timeout,
            reclaim_ack_timeout=settings.reclaim_ack_timeout,
        ),
        engine=EngineConfig(
            reclaim_cap_fraction=settings.reclaim_cap_fraction,
            on_demand_hold_seconds=settings.on_demand_hold_seconds if settings.on_demand_hold_seconds > 0 else None,
            spot_hold_seconds=settings.spot_hold_seconds if settings.spot_hold_seconds > 0 else None,
            rollup_guard_enabled=settings.empty_rollup_guard,
            paused=settings.paused,
            dry_run=settings.dry_run,
        ),
        guard=GuardConfig(enabled=settings.empty_rollup_guard),
        compute_fork=settings.engine_fork,
        engine_mode=settings.engine_mode,
        engine_timeout=settings.engine_timeout,
        engine_nice=settings.engine_nice,
    )
