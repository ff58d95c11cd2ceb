"""`bigfleet shard`: run one shard process."""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2_grpc

from bigfleet.observability import configure_logging
from bigfleet.rpc.options import server_options
from bigfleet.security.metadata import MetadataLimitInterceptor
from bigfleet.security.tls import TLSConfig, add_tls_arguments, tls_from_args_or_exit
from bigfleet.shard.runtime import GC_THRESHOLDS

if TYPE_CHECKING:
    from bigfleet.shard.config import ShardSettings
    from bigfleet.shard.daemon import DaemonConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bigfleet shard", description="Run a shard: sessions, cycles, provider execution.")
    p.add_argument("--config", help="YAML file with settings (flag names, dashes or underscores)")
    p.add_argument("--shard-id")
    p.add_argument("--listen", help="HOST:PORT for Shard, ShardRead and ShardAdmin")
    p.add_argument("--provider", action="append", metavar="[NAME=]HOST:PORT",
                   help="the capacity provider: HOST:PORT, or NAME=HOST:PORT repeated for one pool across "
                        "several providers (machine ids become NAME/<id>; append @exclusive or @shared to "
                        "override --ownership for that provider)")
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
    p.add_argument("--provider-start-grace", type=float, metavar="SECONDS",
                   help="with several providers: how long a new leader waits for all of them to answer before "
                        "deciding on those that did (default 15)")
    p.add_argument("--available-capacity-interval", type=float)
    p.add_argument("--available-capacity-rate", type=float,
                   help="AvailableCapacityUpdate frames written per second, shard-wide (0: unpaced)")
    p.add_argument("--reclaim-cap-fraction", type=float)
    p.add_argument("--disruption-budget", action="append", metavar="RULE",
                   help="a cluster's disruption budget unless its operator sends one, e.g. 10%%/10m or "
                        "'5/1h;reasons=reclaim,release;blackout=Mon-Fri 09:00-17:00' (repeatable; default: "
                        "the reclaim cap fraction per --cycle-interval, reclaims only)")
    p.add_argument("--fleet-disruption-budget", action="append", metavar="RULE",
                   help="a budget for the whole shard (same grammar; repeatable; default none)")
    p.add_argument("--on-demand-hold-seconds", type=int, help="idle on-demand release hold (<= 0: never)")
    p.add_argument("--spot-hold-seconds", type=int, help="idle spot release hold (<= 0: never)")
    p.add_argument("--no-empty-rollup-guard", dest="empty_rollup_guard", action="store_const", const=False)
    p.add_argument("--dry-run", action="store_const", const=True)
    p.add_argument("--engine-mode", choices=["worker", "inline"],
                   help="where the decision engine runs: worker (default: a long-lived process fed deltas) "
                        "or inline (on the event loop: small shards and tests)")
    p.add_argument("--engine-timeout", type=float, help="seconds before a silent engine worker is replaced")
    p.add_argument("--engine-nice", type=int, help="niceness added to the engine worker (0-19; sessions win the CPU)")
    p.add_argument("--paused", action="store_const", const=True)
    p.add_argument("--consolidation", action="store_const", const=True,
                   help="move bound machines onto cheaper supply and repack them onto fewer (off by default; a "
                        "cluster's operator may turn it on or off for its cluster; docs/consolidation.md)")
    p.add_argument("--consolidation-margin", type=float,
                   help="a move must save more than this fraction of the $/h it replaces (default 0.10)")
    p.add_argument("--consolidation-payback-hours", type=float,
                   help="a move must repay its reclamation penalty and drain grace within this long (default 24)")
    p.add_argument("--consolidation-max-moves", type=int,
                   help="machines a cluster may have retired by consolidation per cycle (default 4; budgets apply)")
    ha = p.add_argument_group("replica group (without --raft-bind the shard is a Raft group of one on loopback)")
    ha.add_argument("--replica-id", help="this replica's name (logs, metrics)")
    ha.add_argument("--raft-bind", help="HOST:PORT of this replica's Raft endpoint (also its Raft identity)")
    ha.add_argument("--raft-peers", help="Raft endpoints of the other replicas HOST:PORT,...")
    ha.add_argument("--raft-password", help="shared Raft transport secret (prefer BIGFLEET_SHARD_RAFT_PASSWORD)")
    ha.add_argument("--raft-election-min", type=float, help="seconds (default 3; above 3 heartbeats)")
    ha.add_argument("--raft-election-max", type=float, help="seconds (default 6; above --raft-election-min)")
    ha.add_argument("--raft-leader-fallback", type=float,
                    help="seconds a leader keeps leading without hearing a majority (default 6)")
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
    # Request metadata is bounded first (docs/security.md: 64 entries / 16 KiB), as on every server.
    server = grpc.aio.server(options=server_options(SESSION_SERVER_OPTIONS),
                             interceptors=[MetadataLimitInterceptor(), *interceptors])
    health = grpc_health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    return server, health


def main(argv: list[str]) -> int:
    from bigfleet.shard.config import load_settings

    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.provider:
        from bigfleet.shard.providers import parse_provider_specs

        try:
            parse_provider_specs(ns.provider)  # (the settings check it again with file and environment values)
        except ValueError as exc:
            parser.error(f"--provider: {exc}")
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
        print("bigfleet shard: --provider HOST:PORT (or NAME=HOST:PORT, repeatable) is required", file=sys.stderr)
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


async def serve(settings: ShardSettings, tls: TLSConfig | None = None) -> int:
    from bigfleet.shard.ha.serve import serve as serve_replica

    return await serve_replica(settings, tls)


def daemon_config(settings: ShardSettings, epoch: int) -> DaemonConfig:
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
        provider_start_grace=settings.provider_start_grace,
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
            consolidation=settings.consolidation,
            consolidation_margin=settings.consolidation_margin,
            consolidation_payback_hours=settings.consolidation_payback_hours,
            consolidation_max_moves=settings.consolidation_max_moves,
        ),
        guard=GuardConfig(enabled=settings.empty_rollup_guard),
        engine_mode=settings.engine_mode,
        engine_timeout=settings.engine_timeout,
        engine_nice=settings.engine_nice,
        ownership=settings.ownership,
        disruption_budgets=tuple(settings.disruption_budget),
        fleet_disruption_budgets=tuple(settings.fleet_disruption_budget),
    )
