"""`bigfleet operator` as real processes: two replicas with --leader-elect against the k8stest API server
(on its own thread) and a fake shard; SIGKILL the leader and the standby takes the Session over."""

from __future__ import annotations

import asyncio
import signal
import urllib.request
from pathlib import Path

import pytest
from conftest import cr
from fakeshard import FakeShard, eventually

from bigfleet.k8stest import KubeTestServer
from bigfleet.testing import ManagedProcess, free_port


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        return str(r.read().decode())


@pytest.mark.slow
async def test_two_operator_processes_one_session_and_failover(tmp_path: Path) -> None:
    kube = KubeTestServer(bookmark_interval=1.0).start_in_thread()
    shard = await FakeShard().start()
    kc = kube.kubeconfig(tmp_path / "kubeconfig")
    kube.store.put(cr("a", {"cpu": "3", "memory": "2Gi"}, priority=7))
    ports = [free_port(), free_port()]
    procs = [
        ManagedProcess.bigfleet(
            ["operator", "--cluster-id", "c1", "--shard-addr", shard.target, "--kubeconfig", str(kc),
             "--namespace", "default", "--leader-elect", "--identity", f"op-{i}", "--lease-duration", "4",
             "--renew-deadline", "3", "--retry-period", "0.5", "--metrics-addr", f"127.0.0.1:{ports[i]}"],
            name=f"operator-{i}", log_dir=tmp_path)
        for i in range(2)
    ]
    try:
        procs[0].start()
        await eventually(lambda: shard.rollups, timeout=60, what="roll-up from the first process")
        procs[1].start()
        n = shard.rollups[0].needs[0]
        assert dict(n.aggregate_resources) == {"cpu": "3", "memory": "2Gi"} and n.priority == 7
        await eventually(lambda: (kube.store.find("capacityrequests", "a", "default") or {}).get("status"),
                         what="CR acknowledged")
        metrics = await asyncio.to_thread(scrape, ports[0])
        sent = [float(line.split()[1]) for line in metrics.splitlines()
                if line.startswith("bigfleet_operator_rollups_sent_total ")]
        assert sent and sent[0] >= 1
        assert "bigfleet_operator_leader 1.0" in metrics
        await eventually(lambda: "bigfleet_operator_leader 0.0" in scrape(ports[1]), timeout=60,
                         what="second process up as standby")
        assert shard.sessions_opened == 1
        procs[0].signal(signal.SIGKILL)
        await eventually(lambda: shard.sessions_opened == 2, timeout=60, what="standby takes over")
        assert shard.max_active == 1
        assert kube.store.find("leases", "bigfleet-operator", "default")["spec"]["holderIdentity"] == "op-1"  # type: ignore[index]
        # A clean SIGTERM exits 0 and releases the Lease.
        assert procs[1].stop(timeout=20) == 0
        assert kube.store.find("leases", "bigfleet-operator", "default")["spec"]["holderIdentity"] == ""  # type: ignore[index]
    except BaseException:
        for p in procs:
            print(p.name, p.logs()[-3000:])
        raise
    finally:
        for p in procs:
            p.stop()
        await shard.stop()
        kube.stop_thread()


@pytest.mark.slow
async def test_pod_controller_process_writes_a_capacity_request(tmp_path: Path) -> None:
    kube = KubeTestServer(bookmark_interval=1.0).start_in_thread()
    kc = kube.kubeconfig(tmp_path / "kubeconfig")
    defaults = tmp_path / "pc.yaml"
    defaults.write_text("batch:\n  interruptionPenalty: '12'\n")
    proc = ManagedProcess.bigfleet(
        ["pod-controller", "--kubeconfig", str(kc), "--metrics-addr", "0", "--priority-class-defaults", str(defaults)],
        name="pod-controller", log_dir=tmp_path)
    try:
        proc.start()
        kube.store.put({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": "job", "namespace": "default"},
                        "spec": {"priority": 50, "priorityClassName": "batch",
                                 "containers": [{"name": "c", "image": "i",
                                                 "resources": {"requests": {"cpu": "250m"}}}]},
                        "status": {"phase": "Pending", "conditions": [
                            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}})
        crs = await eventually(lambda: kube.store.objects("capacityrequests"), timeout=60, what="CR written")
        spec = crs[0]["spec"]  # type: ignore[index]
        assert spec["resources"] == {"cpu": "250m"} and spec["priority"] == 50
        assert spec["interruptionPenalty"] == "12"
        assert proc.stop(timeout=20) == 0
    except BaseException:
        print(proc.logs()[-3000:])
        raise
    finally:
        proc.stop()
        kube.stop_thread()
