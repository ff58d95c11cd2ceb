"""The charts' rendered pods, run as real processes: do they make a working fleet?

No Kubernetes cluster is available, so this plays kubelet and kube-dns: it renders the `bigfleet`
and `bigfleet-operator` charts, takes each container's final argv (launcher script run, `$(VAR)`
and `valueFrom` env resolved, the Raft password read from the rendered Secret), maps every
in-cluster DNS name to 127.0.0.1, and starts the daemons. A stand-in API server
(`bigfleet.k8stest`) plays the managed cluster. It then checks what the chart promises: the probes'
health services turn SERVING, the shard registers with the coordinator, the two operator replicas
elect one leader that is placed on the shard through the coordinator, and a CapacityRequest
becomes an UpcomingNode.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import sys
import time
import urllib.request
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


def _ports() -> dict[str, int]:
    names = ["c_grpc", "c_raft", "c_metrics", "s_grpc", "s_raft", "s_metrics", "provider", "op_metrics", "k8s"]
    return {n: free_port() for n in names}


def _control_plane_values(p: dict[str, int], tmp: Path) -> dict[str, Any]:
    return {
        "clusterDomain": DOMAIN,
        "logFormat": "console",
        "coordinator": {
            "replicas": 1,
            "dataDir": str(tmp / "coord"),
            "service": {"grpcPort": p["c_grpc"], "raftPort": p["c_raft"], "metricsPort": p["c_metrics"]},
        },
        "shard": {
            "replicasPerShard": 1,
            "dataDir": str(tmp / "shard"),
            "cycleInterval": "1",
            "service": {"grpcPort": p["s_grpc"], "raftPort": p["s_raft"], "metricsPort": p["s_metrics"]},
        },
        "fakeProvider": {"enabled": True, "port": p["provider"], "extraArgs": ["--committed-count=4", "--seed-count=4"]},
    }


def _to_loopback(arg: str) -> str:
    """kube-dns, played by a regex: every in-cluster service or pod name is this machine."""
    return re.sub(rf"[a-z0-9][a-z0-9.-]*\.svc\.{re.escape(DOMAIN)}", "127.0.0.1", arg)


def _pods(docs: list[cc.Doc], tmp: Path) -> list[tuple[str, list[str], dict[str, str]]]:
    """(pod name, argv, env) for replica 0 of every workload, as kubelet would start it."""
    secrets = {
        d["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in d.get("data", {}).items()}
        for d in docs
        if d["kind"] == "Secret"
    }
    pods = []
    for workload, tmpl in cc.pod_templates(docs):
        replicas = int(workload["spec"].get("replicas", 1))
        for ordinal in range(replicas):
            pod = f"{workload['metadata']['name']}-{ordinal}"
            (container,) = tmpl["spec"]["containers"]
            env: dict[str, str] = {}
            for e in container.get("env", []):
                if "value" in e:
                    env[e["name"]] = e["value"]
                elif "fieldRef" in e["valueFrom"]:
                    field = e["valueFrom"]["fieldRef"]["fieldPath"]
                    env[e["name"]] = {"metadata.name": pod, "metadata.namespace": cc.NAMESPACE}[field]
                else:
                    ref = e["valueFrom"]["secretKeyRef"]
                    env[e["name"]] = secrets[ref["name"]][ref["key"]]
            (cmd,) = [c for c in cc.commands([{**workload, "spec": {**workload["spec"], "template": tmpl}}])]
            argv = _launch(cmd, env, tmp) if cmd.script else [cmd.subcommand, *cmd.args]
            for name, value in env.items():
                argv = [a.replace(f"$({name})", value) for a in argv]
            pods.append((pod, [_to_loopback(a) for a in argv], env))
    return pods


def _launch(cmd: cc.Command, env: dict[str, str], tmp: Path) -> list[str]:
    """Run the pod's launcher script with a `bigfleet` that prints its argv instead of starting."""
    import subprocess

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


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def _metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return None


def test_rendered_charts_start_a_working_fleet(tmp_path: Path) -> None:
    from bigfleet.v1alpha1 import coordinator_pb2, coordinator_pb2_grpc

    for sub in ("coordinator", "shard", "operator", "fake-provider"):
        _, text = cc.run_cli([sub, "--help"])
        if "not available in this build yet" in text:
            pytest.skip(f"`bigfleet {sub}` is not in this build yet")
    p = _ports()
    control = cc.render("bigfleet", _control_plane_values(p, tmp_path), with_crds=False)
    kubeconfig = tmp_path / "kubeconfig"
    operator_values = {
        "clusterID": "e2e",
        "coordinatorAddress": f"bigfleet-coordinator.{cc.NAMESPACE}.svc.{DOMAIN}:{p['c_grpc']}",
        "metricsPort": p["op_metrics"],
        "logFormat": "console",
        "extraArgs": [f"--kubeconfig={kubeconfig}"],
    }
    operator_docs = cc.render("bigfleet-operator", copy.deepcopy(operator_values), with_crds=False)
    control_pods = {pod: (argv, env) for pod, argv, env in _pods(control, tmp_path)}
    operator_pods = _pods(operator_docs, tmp_path)
    assert set(control_pods) == {"bigfleet-coordinator-0", "bigfleet-shard-0-0", "bigfleet-fake-provider-0"}
    assert len(operator_pods) == 2  # the chart's two replicas, one Lease

    logs = tmp_path / "logs"
    procs: list[ManagedProcess] = []

    def start(name: str, argv: list[str], env: dict[str, str], module: bool = False) -> ManagedProcess:
        cmd = [sys.executable, "-m", *argv] if module else [sys.executable, "-m", "bigfleet.cli.main", *argv]
        proc = ManagedProcess(cmd, name, env=env, log_dir=logs).start()
        procs.append(proc)
        return proc

    def running(what: str) -> None:
        dead = [proc for proc in procs if not proc.alive()]
        if dead:
            raise AssertionError(f"{dead[0].name} exited ({dead[0].proc and dead[0].proc.returncode}) while waiting for {what}")

    def wait(predicate: Any, what: str, timeout: float = 90) -> Any:
        """Poll like wait_until, but stop at once when a daemon has died."""
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while True:
            running(what)
            try:
                value = predicate()
                if value:
                    return value
            except Exception as exc:  # daemons may refuse connections while starting
                last = exc
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last!r})")
            time.sleep(0.3)

    def healthy(port: int, service: str = "") -> bool:
        return bool(health_status(f"127.0.0.1:{port}", service) == health_pb2.HealthCheckResponse.SERVING)

    try:
        start("k8stest", ["bigfleet.k8stest", "--port", str(p["k8s"]), "--kubeconfig", str(kubeconfig)], {}, module=True)
        for pod in ("bigfleet-fake-provider-0", "bigfleet-coordinator-0", "bigfleet-shard-0-0"):
            start(pod, *control_pods[pod])
        # The readiness probes' gRPC health services, as the chart declares them.
        wait(lambda: healthy(p["provider"]), "fake provider health")
        wait(lambda: healthy(p["c_grpc"], "bigfleet.v1alpha1.Coordinator"), "coordinator readiness (leader known)")
        wait(lambda: healthy(p["s_grpc"], "bigfleet.v1alpha1.Shard"), "shard readiness")

        with grpc.insecure_channel(f"127.0.0.1:{p['c_grpc']}") as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)

            def shard_registered() -> bool:
                shards = stub.ListShards(coordinator_pb2.ListShardsRequest(), timeout=5).shards
                return any(s.shard_id == "shard-0" for s in shards)

            wait(shard_registered, "shard-0 registered at the coordinator")

        wait(kubeconfig.exists, "k8stest kubeconfig")
        for i, (pod, argv, env) in enumerate(operator_pods):
            # Pods have their own network namespaces; on one host the second replica's metrics
            # listener needs a port of its own.
            if i:
                argv = [f"--metrics-addr=0.0.0.0:{free_port()}" if a.startswith("--metrics-addr=") else a for a in argv]
            start(pod, argv, env)
        api = f"http://127.0.0.1:{p['k8s']}"
        wait(lambda: _metric(p["s_metrics"], "bigfleet_shard_active_sessions") == 1.0, "one operator Session at the shard")
        _post(
            f"{api}/apis/bigfleet.lucy.sh/v1alpha1/namespaces/default/capacityrequests",
            {
                "apiVersion": "bigfleet.lucy.sh/v1alpha1",
                "kind": "CapacityRequest",
                "metadata": {"name": "web-0", "namespace": "default"},
                "spec": {"priority": 1000, "resources": {"cpu": "1", "memory": "1Gi"}},
            },
        )
        nodes = wait(lambda: _get(f"{api}/apis/bigfleet.lucy.sh/v1alpha1/upcomingnodes")["items"], "an UpcomingNode")
        assert nodes[0]["metadata"]["name"].startswith("un-")
        # Still exactly one Session: the standby operator replica did not open a second one.
        assert _metric(p["s_metrics"], "bigfleet_shard_active_sessions") == 1.0
        lease = _get(f"{api}/apis/coordination.k8s.io/v1/namespaces/{cc.NAMESPACE}/leases/bigfleet-operator-leader")
        assert lease["spec"]["holderIdentity"] in {pod for pod, _, _ in operator_pods}
    except BaseException:
        for proc in procs:
            print(f"===== {proc.name} =====\n{proc.logs()[-3000:]}")
        raise
    finally:
        for proc in reversed(procs):
            proc.stop()
