"""``bigfleet operator``: the per-cluster agent (outbound-only Session to its shard)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import signal
import socket
from typing import Any

from bigfleet.observability import configure_logging, get_logger, start_metrics_server
from bigfleet.operator.app import Operator, OperatorConfig, read_file
from bigfleet.operator.kube import api_client
from bigfleet.operator.metrics import OperatorMetrics
from bigfleet.security.tls import TLSConfig, add_tls_arguments, tls_from_args_or_exit


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bigfleet operator", description=__doc__)
    ap.add_argument("--cluster-id", required=True, help="stable identity of this cluster")
    ap.add_argument("--shard-addr", default="", help="HOST:PORT of the shard's Session service")
    ap.add_argument("--coordinator", default="",
                    help="comma-separated coordinator addresses: look the shard up (cached in a ConfigMap)")
    ap.add_argument("--kubeconfig", default="", help="kubeconfig path (default: $KUBECONFIG, ~/.kube/config, in-cluster)")
    ap.add_argument("--namespace", default=os.environ.get("POD_NAMESPACE", "bigfleet-system"),
                    help="namespace of the Lease, the shard cache ConfigMap and the join-token Secret")
    ap.add_argument("--metrics-addr", default=":8770", help='HOST:PORT for /metrics; "0" disables')
    ap.add_argument("--qps", type=float, default=50.0)
    ap.add_argument("--burst", type=int, default=100)
    ap.add_argument("--ack-concurrency", type=int, default=16)
    ap.add_argument("--rollup-interval", type=float, default=0.0, help="seconds; 0 means 10")
    ap.add_argument("--bootstrap-template-file", default="", help="Jinja2 template of the bootstrap blob")
    ap.add_argument("--join-token-secret", default="", help="NAME[/KEY] of a Secret holding the join token")
    ap.add_argument("--leader-elect", action="store_true", help="hold a coordination.k8s.io Lease before streaming")
    ap.add_argument("--lease-name", default="bigfleet-operator")
    ap.add_argument("--identity", default=os.environ.get("POD_NAME") or socket.gethostname())
    ap.add_argument("--lease-duration", type=float, default=15.0)
    ap.add_argument("--renew-deadline", type=float, default=10.0)
    ap.add_argument("--retry-period", type=float, default=2.0)
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--log-format", default="json", choices=["json", "console"])
    add_tls_arguments(ap)
    return ap


async def _join_token(api: Any, namespace: str, ref: str) -> str:
    from kubernetes.aio import client

    name, _, key = ref.partition("/")
    secret = await client.CoreV1Api(api).read_namespaced_secret(name, namespace)
    data = secret.data or {}
    raw = data.get(key or "token")
    if raw is None:
        raise SystemExit(f"secret {namespace}/{name} has no key {key or 'token'!r}")
    return base64.b64decode(raw).decode()


async def run(args: argparse.Namespace, tls: TLSConfig | None = None) -> int:
    log = get_logger("bigfleet.operator", cluster=args.cluster_id)
    metrics = OperatorMetrics()
    if args.metrics_addr not in ("", "0"):
        listen = args.metrics_addr if not args.metrics_addr.startswith(":") else "0.0.0.0" + args.metrics_addr
        start_metrics_server(listen, metrics.registry)
    try:
        api = await api_client(args.kubeconfig or None, args.qps, args.burst)
    except Exception as exc:  # no kubeconfig and not in a cluster, unreadable file, ...
        log.error("cannot configure the Kubernetes client", error=f"{type(exc).__name__}: {exc}")
        return 1
    token = await _join_token(api, args.namespace, args.join_token_secret) if args.join_token_secret else ""
    cfg = OperatorConfig(
        cluster_id=args.cluster_id,
        shard_addr=args.shard_addr,
        coordinators=tuple(a.strip() for a in args.coordinator.split(",") if a.strip()),
        namespace=args.namespace,
        rollup_interval=args.rollup_interval or 10.0,
        ack_concurrency=args.ack_concurrency,
        bootstrap_template=read_file(args.bootstrap_template_file or None),
        join_token=token,
        leader_elect=args.leader_elect,
        lease_name=args.lease_name,
        identity=args.identity,
        lease_duration=args.lease_duration,
        renew_deadline=args.renew_deadline,
        retry_period=args.retry_period,
        tls=tls,
    )
    op = Operator(cfg, api, metrics)
    task = asyncio.create_task(op.run())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, task.cancel)
    log.info("operator started", shard=cfg.shard_addr or None, coordinators=list(cfg.coordinators) or None,
             leader_elect=cfg.leader_elect)
    try:
        await task
    except asyncio.CancelledError:
        log.info("operator stopping")
    finally:
        await api.close()  # type: ignore[no-untyped-call]
    return 0


def main(argv: list[str]) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if bool(args.shard_addr) == bool(args.coordinator):
        ap.error("exactly one of --shard-addr or --coordinator is required")
    tls = tls_from_args_or_exit(ap, args)
    configure_logging(args.log_level, args.log_format, component="operator")
    return asyncio.run(run(args, tls))
