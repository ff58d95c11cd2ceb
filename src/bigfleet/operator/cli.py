"""``bigfleet operator``: the per-cluster agent (outbound-only Session to its shard)."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import re
import signal
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from bigfleet.budget import BudgetError, parse_budget
from bigfleet.observability import configure_logging, get_logger, start_metrics_server
from bigfleet.operator.app import Operator, OperatorConfig, read_file
from bigfleet.operator.bootstrap import ca_cert_hash
from bigfleet.operator.kube import api_client
from bigfleet.operator.metrics import OperatorMetrics
from bigfleet.operator.nodes import parse_duration
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
    ap.add_argument("--disruption-budget", action="append", default=[], metavar="RULE",
                    help="this cluster's disruption budget, overriding the shard's defaults (repeatable): "
                         "NODES/WINDOW[;reasons=R,...][;blackout=DAYS HH:MM-HH:MM|...], e.g. 10%%/10m; "
                         "sent in every roll-up")
    ap.add_argument("--consolidation", default="", choices=["", "on", "off"],
                    help="this cluster's consolidation switch, overriding the shard's (empty: the shard's); "
                         "sent in every roll-up (docs/consolidation.md)")
    ap.add_argument("--node-readiness", default="auto", choices=["auto", "node", "provider"],
                    help="node: an UpcomingNode is Ready once its Node registered and is Ready, and machines "
                         "whose Node never registers are reported; provider: Configured means Ready; auto: "
                         "node unless the development stub bootstrap (no template, no join token) is in use")
    ap.add_argument("--node-registration-timeout", default="15m",
                    help="how long a Configured machine may go without a registered Node before it is reported "
                         "to the shard and replaced (e.g. 900, 900s, 15m; 0 = never)")
    ap.add_argument("--node-ready-timeout", default="30m",
                    help="how long after configuration a registered Node may stay NotReady before the machine is "
                         "reported to the shard and replaced (e.g. 1800, 30m; 0 = never)")
    ap.add_argument("--api-server-endpoint", default="",
                    help="HOST:PORT new machines join (the built-in kubeadm bootstrap); default: kube-public/"
                         "cluster-info, else the kubeconfig's server unless it is the in-cluster Service")
    ap.add_argument("--ca-cert-hash", default="",
                    help="sha256:<hex> of the cluster CA's public key (the built-in kubeadm bootstrap); "
                         "default: computed from the client's CA certificate")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--log-format", default="json", choices=["json", "console"])
    add_tls_arguments(ap)
    return ap


class JoinTokenError(Exception):
    """The join-token Secret cannot be read; the message says which and why (no traceback)."""


#: how long a start-up keeps retrying an API server it cannot reach (or that answers 5xx/429)
JOIN_TOKEN_WAIT = 30.0


async def _read_secret(api: Any, namespace: str, name: str, wait: float = JOIN_TOKEN_WAIT) -> Any:
    """The Secret; an API server not reached yet (a pod starting with its node) is retried for
    `wait` seconds, an answer that will not change (not found, forbidden) ends the start at once."""
    import aiohttp
    from kubernetes.aio import client
    from kubernetes.aio.client.exceptions import ApiException

    deadline = asyncio.get_running_loop().time() + wait
    while True:
        try:
            return await client.CoreV1Api(api).read_namespaced_secret(name, namespace)
        except ApiException as exc:
            if exc.status and exc.status < 500 and exc.status != 429:
                raise JoinTokenError(f"cannot read the join-token Secret {namespace}/{name}: HTTP {exc.status} "
                                     f"{exc.reason}") from None
            why = f"HTTP {exc.status} {exc.reason}"
        except (OSError, TimeoutError, aiohttp.ClientError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        if asyncio.get_running_loop().time() >= deadline:
            raise JoinTokenError(f"cannot read the join-token Secret {namespace}/{name}: the API server did not "
                                 f"answer within {wait:g}s ({why})")
        await asyncio.sleep(1.0)


async def _join_token(api: Any, namespace: str, ref: str, wait: float = JOIN_TOKEN_WAIT) -> str:
    name, _, key = ref.partition("/")
    secret = await _read_secret(api, namespace, name, wait)
    data = secret.data or {}
    raw = data.get(key or "token")
    if raw is None:
        raise JoinTokenError(f"the join-token Secret {namespace}/{name} has no key {key or 'token'!r}")
    return base64.b64decode(raw).decode()


JOIN_TOKEN = re.compile(r"^[a-z0-9]{6}\.[a-z0-9]{16}$")


async def _join_params(api: Any, endpoint: str, ca_hash: str) -> tuple[str, str]:
    """The API server endpoint and CA hash the built-in kubeadm bootstrap needs (flags win)."""
    from kubernetes.aio import client

    cfg = api.configuration
    if not endpoint:
        try:
            cm = await client.CoreV1Api(api).read_namespaced_config_map("cluster-info", "kube-public")
            kc = yaml.safe_load((cm.data or {}).get("kubeconfig") or "") or {}
            server = ((kc.get("clusters") or [{}])[0].get("cluster") or {}).get("server") or ""
            endpoint = urlparse(server).netloc
        except Exception:
            endpoint = ""
    if not endpoint:
        host = urlparse(cfg.host or "").netloc
        if host and os.environ.get("KUBERNETES_SERVICE_HOST", "\0") not in host:
            endpoint = host
    if not ca_hash and cfg.ssl_ca_cert:
        with contextlib.suppress(OSError, ValueError):
            ca_hash = ca_cert_hash(Path(cfg.ssl_ca_cert).read_bytes())
    return endpoint, ca_hash


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
    try:
        token = await _join_token(api, args.namespace, args.join_token_secret) if args.join_token_secret else ""
    except JoinTokenError as exc:
        log.error(str(exc))
        return 1
    template = read_file(args.bootstrap_template_file or None)
    endpoint, ca_hash = args.api_server_endpoint, args.ca_cert_hash
    if template is None and token:
        if not JOIN_TOKEN.match(token.strip()):
            log.error("the join token is not a kubeadm bootstrap token ([a-z0-9]{6}.[a-z0-9]{16}); the built-in "
                      "bootstrap template needs one (or give --bootstrap-template-file)")
            return 1
        token = token.strip()
        endpoint, ca_hash = await _join_params(api, endpoint, ca_hash)
        log.info("built-in kubeadm bootstrap", api_server_endpoint=endpoint or None, ca_cert_hash=ca_hash or None)
        if not endpoint or not ca_hash:
            log.warning("the kubeadm bootstrap lacks an API server endpoint or CA hash; bootstrap requests will be "
                        "answered with an error until --api-server-endpoint / --ca-cert-hash are set")
    elif template is None:
        log.warning("no bootstrap template and no join token: the development stub is served and machines never "
                    "join this cluster (UpcomingNode readiness is taken from the provider)")
    cfg = OperatorConfig(
        cluster_id=args.cluster_id,
        shard_addr=args.shard_addr,
        coordinators=tuple(a.strip() for a in args.coordinator.split(",") if a.strip()),
        namespace=args.namespace,
        rollup_interval=args.rollup_interval or 10.0,
        ack_concurrency=args.ack_concurrency,
        bootstrap_template=template,
        join_token=token,
        leader_elect=args.leader_elect,
        lease_name=args.lease_name,
        identity=args.identity,
        lease_duration=args.lease_duration,
        renew_deadline=args.renew_deadline,
        retry_period=args.retry_period,
        tls=tls,
        disruption_budgets=tuple(args.disruption_budget),
        consolidation=args.consolidation,
        node_readiness=args.node_readiness,
        node_registration_timeout=args.node_registration_timeout_seconds,
        node_ready_timeout=args.node_ready_timeout_seconds,
        api_server_endpoint=endpoint,
        ca_cert_hash=ca_hash,
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
    try:
        parse_budget(args.disruption_budget)
    except BudgetError as exc:
        ap.error(f"--disruption-budget: {exc}")
    try:
        args.node_registration_timeout_seconds = parse_duration(args.node_registration_timeout)
    except ValueError:
        ap.error(f"--node-registration-timeout: not a duration: {args.node_registration_timeout!r}")
    try:
        args.node_ready_timeout_seconds = parse_duration(args.node_ready_timeout)
    except ValueError:
        ap.error(f"--node-ready-timeout: not a duration: {args.node_ready_timeout!r}")
    tls = tls_from_args_or_exit(ap, args)
    configure_logging(args.log_level, args.log_format, component="operator")
    return asyncio.run(run(args, tls))
