"""The charts' rendered pods, run as real processes: do they make a working fleet?

No Kubernetes cluster is available, so this plays one node's kubelet, kube-dns and kube-proxy. It
renders the `bigfleet` chart with its default replica counts (3 coordinators, 3 replicas per shard)
and two shards on one fake provider, and the `bigfleet-operator` chart (2 replicas, one Lease), and
runs every pod of every workload as a local process:

* every pod has its own IP, a loopback address of its own (Linux routes all of 127.0.0.0/8 to
  `lo`; each run takes a random /24 of it), and binding the wildcard address means binding that
  IP, as in the pod's own network namespace: a `0.0.0.0` listen address in its argv becomes the
  pod IP (gRPC binds in C), and a `sitecustomize` does the same for every Python socket the pod
  binds (pysyncobj binds its Raft port on `0.0.0.0` whatever host `--raft-bind` names); so the
  replicas of a StatefulSet use the same ports, as in a cluster;
* every pod gets its own data directory (its PersistentVolumeClaim);
* kube-dns: `<pod>.<headless service>.<ns>.svc.<domain>` names that pod's IP and a ClusterIP
  Service's name its own virtual IP; the names are resolved in the final argv (launcher script
  run, `$(VAR)` and `valueFrom` env resolved, the Raft password read from the rendered Secret);
* kube-proxy: a TCP forwarder on each Service's IP and ports sends each new connection to a pod its
  selector matches whose readinessProbe (the chart's, run by a prober thread per pod, as kubelet
  does) passes. So the shard Service reaches only the replica leading its group, and an operator
  that dials `bigfleet-shard-0...:7780` gets that leader, exactly as the chart promises; the
  coordinator Service reaches every replica that sees a leader, and a follower forwards.

A stand-in API server (`bigfleet.k8stest`) plays the managed cluster. The test checks what the
chart promises: every pod's readiness passes; exactly one replica of each shard is ready (SERVING
on `bigfleet.v1alpha1.Shard`); shard-0 runs `--ownership=exclusive` and shard-1
`--ownership=shared`; both shards register their Service address with the coordinator; the two
operator replicas elect one leader that the coordinator places on a shard, which holds exactly one
Session; a CapacityRequest becomes an UpcomingNode; shard followers (NOT_SERVING on gRPC health:
only the leader serves) still pass their livenessProbe; and the operator's lookup through a
follower coordinator gets the leader's answer (the follower forwards it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

sys.path.insert(0, str(Path(__file__).parent))
import chartcheck as cc

from bigfleet.process.procs import health_status
from bigfleet.testing import ManagedProcess, free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(cc.tools_missing() is not None, reason=cc.tools_missing() or ""),
]

DOMAIN = "cluster.local"
SHARDS = 2
#: how often the stand-in kubelet runs each readiness probe (the chart's periods are 2-10 s; a
#: shorter one only makes the test notice sooner)
PROBE_PERIOD = 0.5
SERVING = health_pb2.HealthCheckResponse.SERVING


def _ports() -> dict[str, int]:
    names = ["c_grpc", "c_raft", "c_metrics", "s_grpc", "s_raft", "s_metrics", "provider", "op_metrics", "k8s"]
    return {n: free_port() for n in names}


def _control_plane_values(p: dict[str, int], tmp: Path) -> dict[str, Any]:
    """Ports and paths for this machine; replica counts are left at the chart's defaults."""
    return {
        "clusterDomain": DOMAIN,
        "logFormat": "console",
        "coordinator": {
            "dataDir": str(tmp / "pvc" / "coordinator"),
            "service": {"grpcPort": p["c_grpc"], "raftPort": p["c_raft"], "metricsPort": p["c_metrics"]},
        },
        "shard": {
            "count": SHARDS,
            "dataDir": str(tmp / "pvc" / "shard"),
            "cycleInterval": "1",
            "service": {"grpcPort": p["s_grpc"], "raftPort": p["s_raft"], "metricsPort": p["s_metrics"]},
        },
        "fakeProvider": {"enabled": True, "port": p["provider"], "extraArgs": ["--committed-count=4", "--seed-count=4"]},
    }


# --- one node: pods, kube-dns, kube-proxy, kubelet's readiness prober ---------------------------


@dataclass(eq=False)
class Pod:
    name: str
    ip: str
    workload: cc.Doc
    container: dict[str, Any]
    labels: dict[str, str]
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def port(self, ref: int | str) -> int:
        """A probe's or Service's port: a number, or the name of one of the container's ports."""
        if isinstance(ref, int):
            return ref
        (number,) = [p["containerPort"] for p in self.container.get("ports", []) if p.get("name") == ref]
        return int(number)

    def flag(self, name: str) -> str:
        (value,) = [a.split("=", 1)[1] for a in self.argv if a.startswith(f"--{name}=")]
        return value


@dataclass
class Service:
    name: str
    ip: str
    ports: dict[int, int | str]  # Service port -> targetPort
    endpoints: list[Pod]


class Node:
    """The pods of some rendered charts on this machine, with their DNS names and Services."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.pods: dict[str, Pod] = {}
        self.services: dict[str, Service] = {}
        self.dns: dict[str, str] = {}
        # This node's block of 127.0.0.0/8: pods from .2 up, Service IPs from .200 up. A random
        # block keeps two runs at once (two checkouts' `make test`) off each other's addresses.
        self.block = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}"
        self.podnet = tmp / "podnet"
        self.podnet.mkdir()
        (self.podnet / "sitecustomize.py").write_text(_PODNET)

    def add(self, docs: list[cc.Doc]) -> list[Pod]:
        """Schedule every replica of every workload in ``docs`` here; returns the new pods."""
        added = []
        for workload, tmpl in cc.pod_templates(docs):
            (container,) = tmpl["spec"]["containers"]
            for ordinal in range(int(workload["spec"].get("replicas", 1))):
                # StatefulSet pods are <name>-<ordinal>; a Deployment's random suffix is an ordinal here too.
                name = f"{workload['metadata']['name']}-{ordinal}"
                pod = Pod(name, f"{self.block}.{len(self.pods) + 2}", workload, container, tmpl["metadata"].get("labels", {}))
                self.pods[name] = pod
                added.append(pod)
                if workload["kind"] == "StatefulSet":
                    self.dns[f"{name}.{workload['spec']['serviceName']}.{cc.NAMESPACE}.svc.{DOMAIN}"] = pod.ip
        for svc in (d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") != "None"):
            name = svc["metadata"]["name"]
            selector = svc["spec"]["selector"]
            endpoints = [p for p in self.pods.values() if all(p.labels.get(k) == v for k, v in selector.items())]
            ports = {int(sp["port"]): sp.get("targetPort", sp["port"]) for sp in svc["spec"]["ports"]}
            self.services[name] = Service(name, f"{self.block}.{len(self.services) + 200}", ports, endpoints)
            self.dns[f"{name}.{cc.NAMESPACE}.svc.{DOMAIN}"] = self.services[name].ip
        secrets = {
            d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in d.get("data", {}).items()}
            for d in docs
            if d["kind"] == "Secret"
        }
        for pod in added:
            self._command(pod, secrets)
        return added

    def resolve(self, arg: str) -> str:
        """kube-dns, played on the argv: every in-cluster name becomes the IP it names here."""

        def lookup(m: re.Match[str]) -> str:
            if m.group(0) not in self.dns:
                raise AssertionError(f"kube-dns: no such name {m.group(0)} (in {arg!r})")
            return self.dns[m.group(0)]

        return re.sub(rf"[a-z0-9][a-z0-9.-]*\.svc\.{re.escape(DOMAIN)}", lookup, arg)

    def _command(self, pod: Pod, secrets: dict[str, dict[str, str]]) -> None:
        """The argv and env kubelet would start ``pod`` with, in the pod's own network and volumes."""
        env: dict[str, str] = {}
        for e in pod.container.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
            elif "fieldRef" in e["valueFrom"]:
                fieldpath = e["valueFrom"]["fieldRef"]["fieldPath"]
                env[e["name"]] = {"metadata.name": pod.name, "metadata.namespace": cc.NAMESPACE}[fieldpath]
            else:
                ref = e["valueFrom"]["secretKeyRef"]
                env[e["name"]] = secrets[ref["name"]][ref["key"]]
        (cmd,) = cc.commands([pod.workload])
        argv = _launch(cmd, env, self.tmp) if cmd.script else [cmd.subcommand, *cmd.args]
        for name, value in env.items():
            argv = [a.replace(f"$({name})", value) for a in argv]
        argv = [self.resolve(a).replace("0.0.0.0:", f"{pod.ip}:") for a in argv]
        # The chart mounts each replica's own PVC at the one dataDir path.
        pod.argv = [f"{a}/{pod.name}" if a.startswith("--data-dir=") else a for a in argv]
        pythonpath = ":".join(filter(None, [str(self.podnet), os.environ.get("PYTHONPATH")]))
        pod.env = {**env, "E2E_POD_IP": pod.ip, "PYTHONPATH": pythonpath}


# The pod's network namespace for Python sockets: a wildcard IPv4 bind binds the pod's IP.
_PODNET = """\
import os
import socket

_ip = os.environ.get("E2E_POD_IP")
if _ip:
    _bind = socket.socket.bind

    def _pod_bind(self, address):
        if self.family == socket.AF_INET and isinstance(address, tuple) and address[0] in ("", "0.0.0.0"):
            address = (_ip, *address[1:])
        return _bind(self, address)

    socket.socket.bind = _pod_bind
"""


def _launch(cmd: cc.Command, env: dict[str, str], tmp: Path) -> list[str]:
    """Run the pod's launcher script with a `bigfleet` that prints its argv instead of starting."""
    shim = tmp / "shim"
    shim.mkdir(exist_ok=True)
    fake = shim / "bigfleet"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    assert cmd.script is not None
    out = subprocess.run(
        ["/bin/sh", "-c", cmd.script],
        env={**env, "PATH": f"{shim}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return out.stdout.splitlines()


def probe(pod: Pod, kind: str = "readinessProbe") -> bool:
    """One run of the pod's probe as kubelet runs it (no probe: passes once started)."""
    spec = pod.container.get(kind)
    if spec is None:
        return True
    try:
        if "grpc" in spec:
            target = f"{pod.ip}:{pod.port(spec['grpc']['port'])}"
            return bool(health_status(target, spec["grpc"].get("service", ""), timeout=1.0) == SERVING)
        if "httpGet" in spec:
            url = f"http://{pod.ip}:{pod.port(spec['httpGet']['port'])}{spec['httpGet'].get('path', '/')}"
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                return bool(200 <= resp.status < 400)
        if "tcpSocket" in spec:
            socket.create_connection((pod.ip, pod.port(spec["tcpSocket"]["port"])), timeout=1.0).close()
            return True
    except (grpc.RpcError, OSError):
        return False
    raise AssertionError(f"{pod.name}: unsupported {kind} {spec}")


class Prober:
    """kubelet's readiness workers: one thread per started pod, its verdict kept for kube-proxy
    (and, for pods given a ``leads`` check, whether the pod leads its Raft group)."""

    def __init__(self) -> None:
        self.ready: dict[str, bool] = {}
        self.leading: dict[str, bool] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def watch(self, pod: Pod, leads: Callable[[Pod], bool] | None = None) -> None:
        def run() -> None:
            while not self._stop.is_set():
                self.ready[pod.name] = probe(pod)
                if leads is not None:
                    self.leading[pod.name] = leads(pod)
                self._stop.wait(PROBE_PERIOD)

        thread = threading.Thread(target=run, name=f"probe-{pod.name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def is_ready(self, pod: Pod) -> bool:
        return self.ready.get(pod.name, False)

    def is_leading(self, pod: Pod) -> bool:
        return self.leading.get(pod.name, False)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)


class KubeProxy:
    """ClusterIP Services: each new connection goes to a ready endpoint; none ready refuses it.

    Like kube-proxy, an established connection stays with its pod after the pod turns unready.
    """

    def __init__(self, services: list[Service], ready: Callable[[Pod], bool]) -> None:
        self.services = services
        self.ready = ready
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kube-proxy", daemon=True)
        self._servers: list[asyncio.Server] = []
        self._conns: set[asyncio.StreamWriter] = set()

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self.loop).result(timeout=10)

    async def _listen(self) -> None:
        for svc in self.services:
            for port, target in svc.ports.items():
                handler = functools.partial(self._forward, svc, target)
                self._servers.append(await asyncio.start_server(handler, svc.ip, port))

    async def _forward(self, svc: Service, target: int | str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        backends = [pod for pod in svc.endpoints if self.ready(pod)]
        if not backends:
            writer.transport.abort()
            return
        pod = random.choice(backends)
        try:
            up_reader, up_writer = await asyncio.open_connection(pod.ip, pod.port(target))
        except OSError:
            writer.transport.abort()
            return
        self._conns |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
                if dst.can_write_eof():
                    dst.write_eof()
            except (OSError, RuntimeError):
                dst.transport.abort()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
                self._conns.discard(w)

    def stop(self) -> None:
        async def close() -> None:
            for server in self._servers:
                server.close()
            for w in list(self._conns):
                w.transport.abort()
            await asyncio.sleep(0.1)  # let the forwarders see their aborted connections

        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


# --- helpers ----------------------------------------------------------------------------------


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def _metric(target: str, name: str) -> float | None:
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return None


class Fleet:
    """The rendered pods of both charts on one Node, and the processes started from them."""

    def __init__(self, tmp: Path) -> None:
        self.p = _ports()
        self.node = Node(tmp)
        self.control = self.node.add(cc.render("bigfleet", _control_plane_values(self.p, tmp), with_crds=False))
        self.kubeconfig = tmp / "kubeconfig"
        operator_values = {
            "clusterID": "e2e",
            "coordinatorAddress": f"bigfleet-coordinator.{cc.NAMESPACE}.svc.{DOMAIN}:{self.p['c_grpc']}",
            "metricsPort": self.p["op_metrics"],
            "logFormat": "console",
            "extraArgs": [f"--kubeconfig={self.kubeconfig}"],
        }
        self.operators = self.node.add(cc.render("bigfleet-operator", operator_values, with_crds=False))
        pods = self.node.pods
        # The chart's defaults: a 3-replica coordinator group and 3 replicas per shard.
        self.coordinators = [pods[f"bigfleet-coordinator-{r}"] for r in range(3)]
        self.shards = {f"shard-{i}": [pods[f"bigfleet-shard-{i}-{r}"] for r in range(3)] for i in range(SHARDS)}
        self.provider = pods["bigfleet-fake-provider-0"]
        # The chart's coordinator Service routes to every replica that sees a leader (2 in 3
        # connections land on a follower, which forwards client RPCs to the leader; ReportShard it
        # refuses with a leader hint, which shards follow).
        self.coordinator_service = self.node.services["bigfleet-coordinator"]
        self.shard_service = {sid: self.node.services[f"bigfleet-{sid}"] for sid in self.shards}
        self.api = f"http://127.0.0.1:{self.p['k8s']}"
        self.logs = tmp / "logs"
        self.procs: list[ManagedProcess] = []
        self.prober = Prober()
        self.proxy = KubeProxy(list(self.node.services.values()), self.prober.is_ready)

    # -- processes ------------------------------------------------------------------------------

    def start(self, name: str, argv: list[str], env: dict[str, str], module: bool = False) -> ManagedProcess:
        cmd = [sys.executable, "-m", *argv] if module else [sys.executable, "-m", "bigfleet.cli.main", *argv]
        proc = ManagedProcess(cmd, name, env=env, log_dir=self.logs).start()
        self.procs.append(proc)
        return proc

    def start_pods(self, pods: list[Pod]) -> None:
        for pod in pods:
            self.start(pod.name, pod.argv, pod.env)
            self.prober.watch(pod, self.coordinator_leads if pod in self.coordinators else None)

    def wait(self, predicate: Any, what: str, timeout: float = 60) -> Any:
        """Poll like wait_until, but stop at once when a daemon has died."""
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while True:
            dead = [proc for proc in self.procs if not proc.alive()]
            if dead:
                raise AssertionError(f"{dead[0].name} exited ({dead[0].proc and dead[0].proc.returncode}) while waiting for {what}")
            try:
                value = predicate()
                if value:
                    return value
            except AssertionError:
                raise
            except Exception as exc:  # daemons may refuse connections while starting
                last = exc
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last!r})")
            time.sleep(0.3)

    @contextlib.contextmanager
    def logs_on_failure(self) -> Any:
        try:
            yield
        except BaseException:
            for proc in self.procs:
                print(f"===== {proc.name} =====\n{proc.logs()[-2500:]}")
            raise

    def stop(self) -> None:
        # Like a namespace deletion: every pod gets SIGTERM at once, then each is waited for.
        for proc in self.procs:
            proc.signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            proc.stop()
        self.prober.stop()
        self.proxy.stop()

    # -- observations ---------------------------------------------------------------------------

    def coordinator_call(self, method: str, request: Any) -> Any:
        """Through the coordinator Service (any replica that sees a leader), following the leader hint."""
        from bigfleet.v1alpha1 import coordinator_pb2_grpc

        target = f"{self.coordinator_service.ip}:{self.p['c_grpc']}"
        for _ in range(3):
            with grpc.insecure_channel(target) as ch:
                try:
                    return getattr(coordinator_pb2_grpc.CoordinatorStub(ch), method)(request, timeout=5)
                except grpc.RpcError as err:
                    details = err.details() or ""
                    if err.code() != grpc.StatusCode.FAILED_PRECONDITION or "leader=" not in details:
                        raise
                    target = details.split("leader=", 1)[1].split()[0].strip(";,")
        raise AssertionError(f"coordinator {method}: no leader after following 3 hints")

    def coordinator_leads(self, pod: Pod) -> bool:
        """True when the coordinator replica answers a call it may not forward (only the leader does)."""
        from bigfleet.coordclient.client import DIRECT_METADATA
        from bigfleet.v1alpha1 import coordinator_pb2, coordinator_pb2_grpc

        with grpc.insecure_channel(f"{pod.ip}:{self.p['c_grpc']}") as ch:
            try:
                coordinator_pb2_grpc.CoordinatorStub(ch).ListShards(
                    coordinator_pb2.ListShardsRequest(), timeout=1.0, metadata=DIRECT_METADATA
                )
            except grpc.RpcError:
                return False
        return True

    def ready_replicas(self, shard_id: str) -> list[Pod]:
        """The replicas of a shard whose readinessProbe passes now (SERVING on bigfleet.v1alpha1.Shard)."""
        return [pod for pod in self.shards[shard_id] if probe(pod)]

    def the_leader(self, shard_id: str, timeout: float = 30) -> Pod:
        """The one ready replica of a shard (waiting out a leader change, if one is under way)."""

        def one() -> Pod | None:
            ready = self.ready_replicas(shard_id)
            return ready[0] if len(ready) == 1 else None

        leader: Pod = self.wait(one, f"exactly one ready replica of {shard_id} (its leader)", timeout)
        return leader

    def sessions(self) -> dict[str, float]:
        """Open Sessions per shard replica, read from each pod (not through the Service)."""
        out = {}
        for group in self.shards.values():
            for pod in group:
                out[pod.name] = _metric(f"{pod.ip}:{self.p['s_metrics']}", "bigfleet_shard_active_sessions") or 0.0
        return out


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The control plane started from the rendered `bigfleet` chart, every Raft group with a leader."""
    for sub in ("coordinator", "shard", "operator", "fake-provider"):
        _, text = cc.run_cli([sub, "--help"])
        if "not available in this build yet" in text:
            pytest.skip(f"`bigfleet {sub}` is not in this build yet")
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    try:
        with f.logs_on_failure():
            f.proxy.start()
            f.start("k8stest", ["bigfleet.k8stest", "--port", str(f.p["k8s"]), "--kubeconfig", str(f.kubeconfig)], {},
                    module=True)
            # podManagementPolicy: Parallel, and nothing orders the workloads: everything at once.
            f.start_pods(f.control)
            # The readiness probes, as the chart declares them.
            f.wait(lambda: f.prober.is_ready(f.provider), "fake provider readiness")
            f.wait(lambda: all(f.prober.is_ready(c) for c in f.coordinators),
                   "coordinator readiness on every replica (leader known)")
            f.wait(lambda: any(f.prober.is_leading(c) for c in f.coordinators), "a coordinator leader that answers")
            for shard_id in f.shards:
                f.wait(lambda sid=shard_id: f.ready_replicas(sid), f"{shard_id} readiness (a replica leads the group)")
        yield f
    finally:
        f.stop()


def test_rendered_charts_start_a_working_fleet(fleet: Fleet) -> None:
    from bigfleet.v1alpha1 import coordinator_pb2

    f, p = fleet, fleet.p
    assert {pod.name for pod in f.control} == {f.provider.name} | {c.name for c in f.coordinators} | {
        pod.name for group in f.shards.values() for pod in group
    }
    assert len(f.operators) == 2  # the chart's two replicas, one Lease
    for shard_id, group in f.shards.items():
        for pod in group:
            assert pod.flag("shard-id") == shard_id
            # One pool owner per provider: shard-0 owns the fake provider's supply, the others start empty.
            assert pod.flag("ownership") == ("exclusive" if shard_id == "shard-0" else "shared"), pod.argv
            assert pod.flag("replica-id") == pod.name
            assert pod.flag("raft-bind") == f"{pod.ip}:{p['s_raft']}"
            peers = pod.flag("raft-peers").split(",")
            assert sorted(peers) == sorted(f"{o.ip}:{p['s_raft']}" for o in group if o is not pod)

    with f.logs_on_failure():
        expected_addresses = {sid: f"{svc.ip}:{p['s_grpc']}" for sid, svc in f.shard_service.items()}

        def shards_registered() -> bool:
            listed = f.coordinator_call("ListShards", coordinator_pb2.ListShardsRequest()).shards
            return {s.shard_id: s.address for s in listed} == expected_addresses

        # Each shard's leader registers the address of the shard's Service, which reaches the leader.
        f.wait(shards_registered, "both shards registered at the coordinator with their Service address")
        # Exactly one replica of each shard is ready: the shard Service has one endpoint, its leader.
        leaders = [f.the_leader(shard_id) for shard_id in f.shards]
        # Liveness of every coordinator replica, the provider and each shard's leader (the
        # followers': test_shard_followers_pass_their_liveness_probe).
        for pod in [*f.coordinators, f.provider, *leaders]:
            assert probe(pod, "livenessProbe"), f"{pod.name}: livenessProbe fails"

        f.wait(f.kubeconfig.exists, "k8stest kubeconfig")
        f.start_pods(f.operators)
        f.wait(lambda: sum(f.sessions().values()) == 1.0, "one operator Session in the fleet")
        # The coordinator placed cluster e2e (rendezvous hashing prefers shard-0 for it), and the
        # Session is on the replica that leads shard-0, reached through the shard-0 Service.
        listed = f.coordinator_call("ListClusterBindings", coordinator_pb2.ListClusterBindingsRequest()).bindings
        assert {b.cluster_id: b.shard_id for b in listed}["e2e"] == "shard-0"
        (holder,) = [name for name, n in f.sessions().items() if n]
        assert holder == f.the_leader("shard-0").name, f"the Session is on {holder}, not on shard-0's leader"

        _post(
            f"{f.api}/apis/bigfleet.lucy.sh/v1alpha1/namespaces/default/capacityrequests",
            {
                "apiVersion": "bigfleet.lucy.sh/v1alpha1",
                "kind": "CapacityRequest",
                "metadata": {"name": "web-0", "namespace": "default"},
                "spec": {"priority": 1000, "resources": {"cpu": "1", "memory": "1Gi"}},
            },
        )
        nodes = f.wait(lambda: _get(f"{f.api}/apis/bigfleet.lucy.sh/v1alpha1/upcomingnodes")["items"], "an UpcomingNode")
        assert nodes[0]["metadata"]["name"].startswith("un-")
        # Still exactly one Session: the standby operator replica did not open a second one.
        f.wait(lambda: sum(f.sessions().values()) == 1.0, "exactly one Session after the UpcomingNode", 15)
        lease = _get(f"{f.api}/apis/coordination.k8s.io/v1/namespaces/{cc.NAMESPACE}/leases/bigfleet-operator-leader")
        assert lease["spec"]["holderIdentity"] in {pod.name for pod in f.operators}
        for pod in f.operators:
            assert probe(pod, "livenessProbe") and probe(pod), f"{pod.name}: probes fail"
        for shard_id in f.shards:
            f.the_leader(shard_id)


def test_shard_followers_pass_their_liveness_probe(fleet: Fleet) -> None:
    followers = [pod for group in fleet.shards.values() for pod in group if not probe(pod)]
    assert len(followers) == 2 * SHARDS
    failing = [pod.name for pod in followers if not probe(pod, "livenessProbe")]
    assert not failing, f"livenessProbe fails on {failing}"


def test_operator_lookup_through_a_follower_coordinator(fleet: Fleet) -> None:
    from kubernetes.aio import client

    from bigfleet.operator.app import CoordinatorResolver

    followers = [pod for pod in fleet.coordinators if not fleet.coordinator_leads(pod)]
    assert len(followers) == 2
    want = f"{fleet.shard_service['shard-0'].ip}:{fleet.p['s_grpc']}"

    async def lookup(pod: Pod) -> str | None:
        async with client.ApiClient() as api:
            coordinators = (f"{pod.ip}:{fleet.p['c_grpc']}",)
            return await CoordinatorResolver("e2e", coordinators, api, cc.NAMESPACE).lookup()

    assert {pod.name: asyncio.run(lookup(pod)) for pod in followers} == {pod.name: want for pod in followers}
