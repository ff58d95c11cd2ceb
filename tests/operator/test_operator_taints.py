"""Taints end to end: ``bigfleet fake-provider --node-taint`` declares them on its machines, the real
shard forwards them in NodeStateUpdate.taints and the real operator writes them into the UpcomingNode
spec (real processes, test API server)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import cr
from fakeshard import eventually

from bigfleet.k8stest import KubeTestServer
from bigfleet.testing import ManagedProcess, free_port, wait_for_health


@pytest.mark.slow
async def test_provider_taints_reach_the_upcoming_node(tmp_path: Path) -> None:
    kube = KubeTestServer(bookmark_interval=1.0).start_in_thread()
    kc = kube.kubeconfig(tmp_path / "kubeconfig")
    pp, sp = free_port(), free_port()
    procs = [
        ManagedProcess.bigfleet(["fake-provider", "--listen", f"127.0.0.1:{pp}", "--seed-count", "4",
                                 "--node-taint", "nvidia.com/gpu=present:NoSchedule",
                                 "--node-taint", "dedicated:PreferNoSchedule"], "provider", log_dir=tmp_path),
        ManagedProcess.bigfleet(["shard", "--listen", f"127.0.0.1:{sp}", "--provider", f"127.0.0.1:{pp}",
                                 "--data-dir", str(tmp_path / "data"), "--cycle-interval", "1", "--shard-id", "s0"],
                                "shard", log_dir=tmp_path),
        ManagedProcess.bigfleet(["operator", "--cluster-id", "c1", "--shard-addr", f"127.0.0.1:{sp}",
                                 "--kubeconfig", str(kc), "--namespace", "default", "--metrics-addr", "0"],
                                "operator", log_dir=tmp_path),
    ]
    s = kube.store
    try:
        for p in procs:
            p.start()

        def shard_up() -> bool:
            assert all(p.alive() for p in procs), "a daemon exited"
            try:
                wait_for_health(f"127.0.0.1:{sp}", 0.5)
                return True
            except TimeoutError:
                return False

        await eventually(shard_up, timeout=60, what="shard serving")
        s.put(cr("gpu-job", {"cpu": "1"}, priority=100))

        def tainted() -> list[dict[str, object]]:
            assert all(p.alive() for p in procs), "a daemon exited"
            return [o for o in s.objects("upcomingnodes") if (o.get("spec") or {}).get("taints")]

        nodes = await eventually(tainted, timeout=90, what="an UpcomingNode with taints")
        assert nodes[0]["spec"]["taints"] == [  # type: ignore[index]
            {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
            {"key": "dedicated", "effect": "PreferNoSchedule"},
        ]
        assert all((o.get("spec") or {}).get("taints") for o in s.objects("upcomingnodes"))
    except BaseException:
        for p in procs:
            print(p.name, p.logs()[-2000:])
        raise
    finally:
        for p in reversed(procs):
            p.stop()
        kube.stop_thread()
