"""``bigfleet pod-controller``: write a CapacityRequest for each unschedulable pod.

With ``--leader-elect`` only the replica holding a ``coordination.k8s.io/v1`` Lease runs the controller
(the operator's elector): two active replicas would each create a CapacityRequest for the same pod,
since requests are named with ``generateName``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
from pathlib import Path

import yaml

from bigfleet.observability import configure_logging, get_logger, start_metrics_server
from bigfleet.operator.kube import api_client
from bigfleet.operator.leader import LeaseElector
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
    ap.add_argument("--leader-elect", action="store_true",
                    help="run only while holding a coordination.k8s.io Lease (required with more than one replica)")
    ap.add_argument("--lease-name", default="bigfleet-pod-controller")
    ap.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", "bigfleet-system"))
    ap.add_argument("--identity", default=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
                    help="holder identity written into the Lease (default: $POD_NAME, else host-pid)")
    ap.add_argument("--lease-duration", type=float, default=15.0,
                    help="seconds a standby waits after the last renewal it saw before taking over")
    ap.add_argument("--renew-deadline", type=float, default=10.0,
                    help="seconds a leader keeps working without a successful renewal")
    ap.add_argument("--retry-period", type=float, default=2.0)
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
    log = get_logger("bigfleet.podcontroller")

    async def work() -> None:
        # A fresh controller per term: informer caches from an earlier term may be stale.
        metrics.leader.set(1)
        try:
            await PodController(api, defaults or {}, all_pods=args.all_pods, metrics=metrics).run()
        finally:
            metrics.leader.set(0)

    if args.leader_elect:
        elector = LeaseElector(api, args.lease_namespace, args.lease_name, args.identity,
                               lease_duration=args.lease_duration, renew_deadline=args.renew_deadline,
                               retry_period=args.retry_period)
        task = asyncio.create_task(elector.run(work))
    else:
        task = asyncio.create_task(work())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, task.cancel)
    log.info("pod controller started", all_pods=args.all_pods, leader_elect=args.leader_elect,
             identity=args.identity if args.leader_elect else None)
    try:
        await task
    except asyncio.CancelledError:
        pass
    finally:
        await api.close()  # type: ignore[no-untyped-call]
    return 0


def main(argv: list[str]) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.leader_elect and not args.lease_duration > args.renew_deadline > args.retry_period > 0:
        ap.error("need --lease-duration > --renew-deadline > --retry-period > 0")
    configure_logging(args.log_level, args.log_format, component="pod-controller")
    return asyncio.run(run(args))
