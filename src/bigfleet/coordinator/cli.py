"""`bigfleet coordinator`: run a replica, or `bigfleet coordinator restore` offline."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

from bigfleet.observability import configure_logging, get_logger
from bigfleet.raft import RaftSettingsError
from bigfleet.security.raft import MIN_LENGTH as RAFT_PASSWORD_MIN_LENGTH


def _csv(v: str) -> list[str]:
    return [x.strip() for x in v.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bigfleet coordinator", description="Run a coordinator replica (Raft fleet state).")
    p.add_argument("--node-id", "--id", dest="node_id", default="node-1", help="this replica's id")
    p.add_argument("--listen", default="0.0.0.0:7790", help="gRPC HOST:PORT")
    p.add_argument("--advertise-addr", default="", help="gRPC address other replicas hand out as leader hint")
    p.add_argument("--raft-bind", default="0.0.0.0:7791", help="Raft HOST:PORT to bind")
    p.add_argument("--raft-advertise", default="", help="Raft address peers dial (defaults to --raft-bind)")
    p.add_argument("--raft-peers", default="", help="comma-separated Raft addresses of the other replicas")
    p.add_argument("--data-dir", default="./coord-data")
    p.add_argument("--metrics-listen", "--metrics-addr", dest="metrics_listen", default="", help='HOST:PORT for /metrics ("" or "0" disables)')
    p.add_argument(
        "--raft-password-file",
        default="",
        help="file holding the Raft transport password (else $BIGFLEET_RAFT_PASSWORD); required",
    )
    p.add_argument("--http-listen", default="", help="HOST:PORT for the read-only dashboard and its JSON (empty = off)")
    p.add_argument("--down-after", type=float, default=60.0, help="seconds of silence before a shard counts as down")
    p.add_argument("--snapshot-export-dir", default="")
    p.add_argument("--snapshot-export-interval", type=float, default=0.0, help="seconds; 0 means 300")
    p.add_argument("--rebalance-interval", type=float, default=10.0, help="inventory rebalancer period; 0 disables")
    p.add_argument("--transfer-cooldown", type=float, default=60.0)
    p.add_argument("--load-factor", type=float, default=1.25, help="bounded-load cap factor c")
    p.add_argument("--join-addr", default="", help="coordinator gRPC address(es) to ask for Raft membership")
    p.add_argument(
        "--bootstrap",
        action="store_true",
        help="accepted for compatibility with upstream manifests; not needed (the --raft-peers group forms itself)",
    )
    p.add_argument("--raft-compaction-entries", type=int, default=20_000, help="snapshot the Raft log after this many entries")
    p.add_argument("--raft-election-min", type=float, default=0.3,
                   help="seconds; above 3 heartbeats (0.15 s) and below --raft-election-max")
    p.add_argument("--raft-election-max", type=float, default=0.6,
                   help="seconds; at most 1.0 (the Raft connection timeout)")
    try:
        from bigfleet.security.tls import add_tls_arguments

        add_tls_arguments(p)
    except ImportError:  # pragma: no cover - security package always ships
        pass
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="json", choices=["json", "console"])
    return p


def _restore_main(argv: list[str]) -> int:
    from bigfleet.coordinator.snapshot import SnapshotError, prepare_restore

    p = argparse.ArgumentParser(prog="bigfleet coordinator restore", description="Offline restore to a single voter.")
    p.add_argument("--archive", required=True, help="tar from `bigfleetctl snapshot save` or an export directory")
    p.add_argument("--data-dir", required=True)
    args = p.parse_args(argv)
    try:
        meta = prepare_restore(Path(args.archive), Path(args.data_dir))
    except SnapshotError as exc:
        print(f"restore failed: {exc}", file=sys.stderr)
        return 1
    print(
        f"restored snapshot index={meta.get('Index')} term={meta.get('Term')} into {args.data_dir}; "
        "start this replica with no --raft-peers (single voter) and join the others with `bigfleetctl raft join`"
    )
    return 0


def _password(args: argparse.Namespace) -> str:
    if args.raft_password_file:
        return Path(args.raft_password_file).read_text().strip()
    return os.environ.get("BIGFLEET_RAFT_PASSWORD", "")


def _check_raft_flags_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse Raft timings pysyncobj would only assert on (a bare AssertionError), naming the flag: exit 2."""
    from bigfleet.coordinator.raft import RaftConfig
    from bigfleet.raft import timing_problems

    settings = RaftConfig(self_address="", peers=[], data_dir=Path(args.data_dir), password="",
                          election_min=args.raft_election_min, election_max=args.raft_election_max,
                          compaction_min_entries=args.raft_compaction_entries)
    problems = timing_problems(settings, {"election_min": "--raft-election-min", "election_max": "--raft-election-max",
                                          "compaction_min_entries": "--raft-compaction-entries"})
    if problems:
        parser.error("; ".join(problems))


def main(argv: list[str]) -> int:
    if argv and argv[0] == "restore":
        return _restore_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    from bigfleet.security.tls import tls_from_args_or_exit

    tls = tls_from_args_or_exit(parser, args)
    _check_raft_flags_or_exit(parser, args)
    password = _password(args)
    if not password:
        print(
            "bigfleet coordinator: a Raft password is required (--raft-password-file or BIGFLEET_RAFT_PASSWORD): "
            "pysyncobj's transport is pickle, so an unauthenticated Raft port would run anyone's code",
            file=sys.stderr,
        )
        return 2
    if len(password) < RAFT_PASSWORD_MIN_LENGTH:
        print(f"bigfleet coordinator: the Raft password is shorter than {RAFT_PASSWORD_MIN_LENGTH} characters "
              "(docs/security.md, \"The Raft ports\")", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format, component="coordinator")
    log = get_logger("coordinator")
    from bigfleet.coordinator.server import CoordinatorConfig, CoordinatorDaemon

    cfg = CoordinatorConfig(
        node_id=args.node_id,
        listen=args.listen,
        raft_bind=args.raft_bind,
        data_dir=Path(args.data_dir),
        password=password,
        raft_advertise=args.raft_advertise,
        raft_peers=_csv(args.raft_peers),
        advertise=args.advertise_addr,
        metrics_listen=args.metrics_listen,
        down_after=args.down_after,
        snapshot_export_dir=args.snapshot_export_dir,
        snapshot_export_interval=args.snapshot_export_interval or 300.0,
        rebalance_interval=args.rebalance_interval,
        transfer_cooldown=args.transfer_cooldown,
        load_factor=args.load_factor,
        join_addr=args.join_addr,
        raft_election_min=args.raft_election_min,
        raft_election_max=args.raft_election_max,
        raft_compaction_entries=args.raft_compaction_entries,
        tls=tls,
    )

    async def run() -> None:
        daemon = CoordinatorDaemon(cfg)
        await daemon.start()
        dashboard = None
        if args.http_listen:
            from bigfleet.dashboard import DashboardServer
            from bigfleet.dashboard.coordinator_source import CoordinatorSource

            dashboard = DashboardServer(CoordinatorSource(daemon, args.down_after), args.http_listen)
            try:
                await dashboard.start()
            except (OSError, ValueError) as exc:
                log.error("cannot listen for the dashboard", http_listen=args.http_listen, error=str(exc))
                dashboard = None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("coordinator stopping")
        if dashboard is not None:
            await dashboard.stop()
        await daemon.stop()

    try:
        asyncio.run(run())
    except (OSError, RaftSettingsError) as exc:  # a busy port, an unusable Raft address: no traceback
        print(f"bigfleet coordinator: {exc}", file=sys.stderr)
        return 1
    return 0
