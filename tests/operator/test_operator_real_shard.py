"""Smoke test against the real shard and fake provider processes (wire compatibility of the operator with
the project's own shard): a CapacityRequest becomes a Ready UpcomingNode, an AvailableCapacity hint and an
Acknowledged CR. The full end-to-end suite lives with issue #9."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import cr
from fakeshard import eventually

from bigfleet.k8stest import KubeTestServer
from bigfleet.testing import ManagedProcess, free_port, wait_for_health


@pytest.mark.slow
async def test_operator_against_the_real_shard(tmp_path: Path) -> None:
    kube = KubeTestServer(bookmark_interval=1.0).start_in_thread()
    kc = kube.kubeconfig(tmp_path / "kubeconfig")
    pp, sp = free_port(), free_port()
    procs = [
        ManagedProcess.bigfleet(["fake-provider", "--listen", f"127.0.0.1:{pp}", "--seed-count", "4"],
                                "provider", log_dir=tmp_path),
        ManagedProcess.bigfleet(["shard", "--listen", f"127.0.0.1:{sp}", "--provider", f"127.0.0.1:{pp}",
                                 "--data-dir", str(tmp_path / "data"), "--cycle-interval", "1", "--shard-id", "s0"],
                                "shard", log_dir=tmp_path),
        ManagedProcess.bigfleet(["operator", "--cluster-id", "c1", "--shard-addr", f"127.0.0.1:{sp}",
                                 "--kubeconfig", str(kc), "--namespace", "default", "--metrics-addr", "0"],
                                "operator", log_dir=tmp_path),
    ]
    s = kube.store
    try:
        procs[0].start()
        procs[1].start()

        def shard_up() -> bool:
            assert all(p.alive() for p in procs[:2]), "provider or shard exited"
            try:
                wait_for_health(f"127.0.0.1:{sp}", 0.5)
                return True
            except TimeoutError:
                return False

        await eventually(shard_up, timeout=60, what="shard serving")
        s.put(cr("a", {"cpu": "1"}, priority=100))
        procs[2].start()
        def ready() -> bool:
            assert all(p.alive() for p in procs), "a daemon exited"
            return any((o.get("status") or {}).get("phase") == "Ready" for o in s.objects("upcomingnodes"))

        await eventually(ready, timeout=90, what="a Ready UpcomingNode")
        await eventually(lambda: s.objects("availablecapacities"), timeout=30, what="an AvailableCapacity")
        assert (s.find("capacityrequests", "a", "default") or {}).get("status", {}).get("phase") == "Acknowledged"
        ready = [o for o in s.objects("upcomingnodes") if o["status"]["phase"] == "Ready"]
        assert len(ready) == 1 and ready[0]["metadata"]["name"].startswith("un-")
        assert ready[0]["status"].get("nodeRef", {}).get("name")
    except BaseException:
        for p in procs:
            print(p.name, p.logs()[-2000:])
        raise
    finally:
        for p in reversed(procs):
            p.stop()
        kube.stop_thread()
