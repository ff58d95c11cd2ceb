"""``bigfleet pod-controller``: write a CapacityRequest for each unschedulable pod."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path

import yaml

from bigfleet.observability import configure_logging, get_logger, start_metrics_server
from bigfleet.operator.kube import api_client
from bigfleet.podcontroller.controller import PodController, PodControllerMetrics


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bigfleet pod-controller", description=__doc__)
    ap.add_argument("--kubeconfig", default="")
    ap.add_argument("--metrics-addr", default=":8080", help='HOST:PORT for /metrics; "0" disables')
    ap.add_argument("--priority-class-defaults", default="",
                    help="YAML: <priorityClassName>: {interruptionPenalty: <qty>, reclamationPenalty: <qty>}")
    ap.add_argument("--all-pods", action="store_true", help="a CR for every non-terminal pod, not only unschedulable")
    ap.add_argument("--qps", type=float, default=50.0)
    ap.add_argument("--burst", type=int, default=100)
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--log-format", default="json", choices=["json", "console"])
    return ap


async def run(args: argparse.Namespace) -> int:
    defaults = yaml.safe_load(Path(args.priority_class_defaults).read_text()) if args.priority_class_defaults else {}
    try:
        api = await api_client(args.kubeconfig or None, args.qps, args.burst)
    except Exception as exc:
        get_logger("bigfleet.podcontroller").error("cannot configure the Kubernetes client",
                                                   error=f"{type(exc).__name__}: {exc}")
        return 1
    metrics = PodControllerMetrics()
    if args.metrics_addr not in ("", "0"):
        listen = args.metrics_addr if not args.metrics_addr.startswith(":") else "0.0.0.0" + args.metrics_addr
        start_metrics_server(listen, metrics.registry)
    ctl = PodController(api, defaults or {}, all_pods=args.all_pods, metrics=metrics)
    task = asyncio.create_task(ctl.run())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, task.cancel)
    get_logger("bigfleet.podcontroller").info("pod controller started", all_pods=args.all_pods)
    try:
        await task
    except asyncio.CancelledError:
        pass
    finally:
        await api.close()  # type: ignore[no-untyped-call]
    return 0


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format, component="pod-controller")
    return asyncio.run(run(args))
