"""Two ``bigfleet pod-controller --leader-elect`` processes against the test API server: only the Lease
holder writes CapacityRequests (they are named with generateName, so a second writer would duplicate
them); killing the holder without a release hands the work to the standby after the lease expires."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from bigfleet.k8stest import KubeTestServer
from bigfleet.podcontroller.derive import OWNED_BY_POD_LABEL
from bigfleet.testing import ManagedProcess, wait_until

LEASE = "bigfleet-pod-controller"
LEASE_S = 3.0


def _pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": [{"name": "c", "image": "i", "resources": {"requests": {"cpu": "1"}}}]},
            "status": {"phase": "Pending",
                       "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}}


@pytest.mark.slow
def test_only_the_lease_holder_acts_and_a_killed_holder_hands_over(tmp_path: Path) -> None:
    kube = KubeTestServer(bookmark_interval=1.0).start_in_thread()
    kc = kube.kubeconfig(tmp_path / "kubeconfig")
    s = kube.store

    def replica(identity: str) -> ManagedProcess:
        return ManagedProcess.bigfleet(
            ["pod-controller", "--kubeconfig", str(kc), "--metrics-addr", "0", "--leader-elect",
             "--lease-namespace", "default", "--identity", identity, "--lease-duration", str(LEASE_S),
             "--renew-deadline", "2", "--retry-period", "0.5"], f"pc-{identity}", log_dir=tmp_path)

    procs = {i: replica(i) for i in ("a", "b")}

    def holder() -> str:
        lease = s.find("leases", LEASE, "default") or {}
        return str((lease.get("spec") or {}).get("holderIdentity") or "")

    def crs_for(pod: dict[str, Any]) -> list[dict[str, Any]]:
        uid = pod["metadata"]["uid"]
        return [o for o in s.objects("capacityrequests")
                if (o["metadata"].get("labels") or {}).get(OWNED_BY_POD_LABEL) == uid]

    try:
        for p in procs.values():
            p.start()
        leader = wait_until(holder, timeout=60, what="a Lease holder")
        standby = "b" if leader == "a" else "a"
        p1 = s.put(_pod("p1"))
        wait_until(lambda: crs_for(p1), timeout=60, what="a CapacityRequest for p1")
        p2 = s.put(_pod("p2"))
        wait_until(lambda: crs_for(p2), timeout=60, what="a CapacityRequest for p2")
        # Both replicas watch the same pods; only one wrote, once per pod.
        assert len(crs_for(p1)) == 1 and len(crs_for(p2)) == 1
        assert holder() == leader and all(p.alive() for p in procs.values())
        assert '"leading"' in procs[leader].logs() and '"leading"' not in procs[standby].logs()

        procs[leader].kill()  # no release: the standby must wait the lease out
        killed_at = time.monotonic()
        p3 = s.put(_pod("p3"))
        wait_until(lambda: holder() == standby, timeout=60, what="the standby takes the Lease")
        wait_until(lambda: crs_for(p3), timeout=60, what="the new holder serves p3")
        handover = time.monotonic() - killed_at
        print(f"handover after kill: {handover:.2f}s (lease {LEASE_S}s)")
        assert len(crs_for(p1)) == 1 and len(crs_for(p2)) == 1 and len(crs_for(p3)) == 1
        lease = s.find("leases", LEASE, "default") or {}
        assert int(lease["spec"].get("leaseTransitions") or 0) >= 1
        assert '"leading"' in procs[standby].logs()
    except BaseException:
        for p in procs.values():
            print(p.name, p.logs()[-3000:])
        raise
    finally:
        for p in procs.values():
            p.stop()
        kube.stop_thread()
