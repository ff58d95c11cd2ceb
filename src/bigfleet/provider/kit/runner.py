"""The daemon shell every kit-based provider shares: flags, signals, health, metrics.

    parser = argparse.ArgumentParser(); add_common_args(parser)
    args = parser.parse_args(argv)
    return run(MyBackend(), args)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry

from bigfleet.observability import configure_logging, get_logger, new_registry, start_metrics_server
from bigfleet.provider.kit.backend import Backend
from bigfleet.provider.kit.faults import ConformanceFaults, fault_timeout, faults_enabled
from bigfleet.provider.kit.server import KitOptions, ProviderServer, serve
from bigfleet.provider.kit.store import FileStore, NullStore, Store


def add_common_args(p: argparse.ArgumentParser, default_listen: str = "127.0.0.1:9400") -> None:
    p.add_argument("--listen", default=default_listen, help="HOST:PORT to serve gRPC on (port 0 picks one)")
    p.add_argument("--state-file", default="", help="JSON state file; durable across restarts (empty = in memory)")
    p.add_argument("--transition-timeout", type=float, default=None,
                   help="seconds before any transition is declared FAILED (default: create/configure/delete "
                        "300, drain 600)")
    p.add_argument("--require-zone", action="store_true", help="refuse backend records without a zone")
    p.add_argument("--reconcile-interval", type=float, default=0.0,
                   help="seconds between Describe reconciles (prices, probabilities, new machines); 0 = off")
    p.add_argument("--metrics-listen", default="", help="HOST:PORT for /metrics (empty = off)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-format", default="json", choices=["json", "console"])
    p.add_argument("--conformance-faults", action="store_true",
                   help="enable the conformance fault hooks (also BIGFLEET_CONFORMANCE_FAULTS=1)")
    from bigfleet.security import add_tls_arguments

    add_tls_arguments(p)  # --tls-cert/--tls-key/--tls-ca: all three or none


def options_from_args(args: argparse.Namespace, base: KitOptions | None = None) -> KitOptions:
    opts = base or KitOptions()
    t = args.transition_timeout
    if args.conformance_faults or faults_enabled():
        t = t if t is not None else fault_timeout()
    if t is not None:
        if t <= 0:
            raise SystemExit("--transition-timeout must be > 0")
        opts = replace(opts, create_timeout=t, configure_timeout=t, drain_timeout=t, delete_timeout=t)
    return replace(opts, require_zone=args.require_zone or opts.require_zone)


async def serve_until_signal(
    backend: Backend, args: argparse.Namespace, options: KitOptions | None = None, component: str = "provider",
    tls: Any = None, store: Store | None = None, registry: CollectorRegistry | None = None,
) -> int:
    log = get_logger("bigfleet.provider", component=component)
    opts = options_from_args(args, options)
    if args.conformance_faults or faults_enabled():
        backend = ConformanceFaults(backend, timeout=opts.configure_timeout)
        log.warning("conformance fault hooks enabled", transition_timeout=opts.configure_timeout)
    if store is None:  # a caller-built store (e.g. the fake provider's prebind seed) wins over --state-file
        store = FileStore(args.state_file) if args.state_file else NullStore()
    if registry is None:  # a caller-built registry lets a provider add its own metrics to /metrics
        registry = new_registry(process_metrics=True)
    running = await serve(backend, args.listen, store, opts, registry, tls=tls)
    metrics = start_metrics_server(args.metrics_listen, registry) if args.metrics_listen else None
    log.info("provider serving", listen=args.listen, port=running.port, machines=len(running.provider.core.machines),
             state_file=args.state_file or None, revision=running.provider.core.rev)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    reconciler = None
    if args.reconcile_interval > 0:
        reconciler = asyncio.create_task(_reconcile_loop(running.provider, args.reconcile_interval, log))
    await stop.wait()
    log.info("provider stopping")
    if reconciler is not None:
        reconciler.cancel()
    await running.stop(grace=1.0)
    if metrics is not None:
        metrics.stop()
    return 0


async def _reconcile_loop(provider: ProviderServer, interval: float, log: object) -> None:
    """Fold the backend's current truth in periodically; a failed Describe is logged and retried."""
    while True:
        await asyncio.sleep(interval)
        try:
            changed = await provider.reconcile()
            if changed:
                log.info("reconciled with the backend", changed=changed)  # type: ignore[attr-defined]
        except Exception as exc:
            log.warning("reconcile failed", error=str(exc))  # type: ignore[attr-defined]


def run(backend: Backend, args: argparse.Namespace, options: KitOptions | None = None,
        component: str = "provider", store: Store | None = None,
        registry: CollectorRegistry | None = None) -> int:
    from bigfleet.security import TLSConfig, TLSConfigError

    try:
        tls = TLSConfig.from_args(args)  # None without the flags; a partial set is a startup error
    except TLSConfigError as exc:
        print(f"bigfleet {component}: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level, args.log_format, component=component)
    try:
        return asyncio.run(serve_until_signal(backend, args, options, component, tls=tls, store=store,
                                              registry=registry))
    except OSError as exc:  # (a busy --listen or --metrics-listen: say so, no traceback)
        print(f"bigfleet {component}: {exc}", file=sys.stderr)
        return 1
