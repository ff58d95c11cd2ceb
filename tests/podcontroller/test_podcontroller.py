"""Pod controller: pure derivation, and the real controller against the k8stest API server."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

from kubernetes.aio import config

from bigfleet.k8stest import KubeTestServer
from bigfleet.podcontroller.controller import PodController
from bigfleet.podcontroller.derive import OWNED_BY_POD_LABEL, capacity_request_spec, pod_request


def pod(name: str, containers: list[dict[str, Any]], *, unschedulable: bool = True, **spec: Any) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Pending"}
    if unschedulable:
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"containers": containers, **spec}, "status": status}


def ctr(cpu: str, mem: str = "", **kw: Any) -> dict[str, Any]:
    req = {"cpu": cpu, **({"memory": mem} if mem else {})}
    return {"name": "c", "image": "i", "resources": {"requests": req}, **kw}


def test_effective_request_follows_the_scheduler_rule() -> None:
    spec = {
        "containers": [ctr("1", "1Gi"), ctr("500m", "1Gi")],
        "initContainers": [
            ctr("2", "512Mi"),  # plain init: peaks alone
            {**ctr("250m", "256Mi"), "restartPolicy": "Always"},  # sidecar: runs with the app
            ctr("3"),  # plain init after the sidecar: 3 + 0.25 = 3.25 cpu peak
        ],
        "overhead": {"cpu": "100m"},
    }
    # memory: app 2Gi + sidecar 256Mi beats every init step
    assert pod_request(spec) == {"cpu": 3350, "memory": 2304 * (1 << 20) * 1000}


def test_limits_count_when_requests_are_missing() -> None:
    spec = {"containers": [{"name": "c", "image": "i", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}
    assert pod_request(spec) == {"nvidia.com/gpu": 8000}


def test_spec_requirements_colocation_spread_and_penalties() -> None:
    p = pod("p", [ctr("1")], priority=1000, priorityClassName="batch",
            nodeSelector={"zone": "a", "arch": "amd64"},
            affinity={
                "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "Exists"},
                                          {"key": "mem", "operator": "Gt", "values": ["3"]}]},
                    {"matchExpressions": [{"key": "ignored", "operator": "Exists"}]}]}},
                "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                    {"topologyKey": "rack", "labelSelector": {"matchLabels": {"gang": "g"}}}]},
            },
            topologySpreadConstraints=[
                {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"},
                {"maxSkew": 1, "topologyKey": "host", "whenUnsatisfiable": "ScheduleAnyway"}])
    p["metadata"]["annotations"] = {"bigfleet.lucy.sh/interruption-penalty": "250"}
    spec = capacity_request_spec(p, {"batch": {"interruptionPenalty": "1", "reclamationPenalty": "40"}})
    assert spec == {
        "priority": 1000,
        "resources": {"cpu": "1"},
        "requirements": [{"key": "gpu", "operator": "Exists"},
                         {"key": "arch", "operator": "In", "values": ["amd64"]},
                         {"key": "zone", "operator": "In", "values": ["a"]}],
        "coLocation": {"topologyKey": "rack", "labelSelector": {"matchLabels": {"gang": "g"}}},
        "topologySpread": [{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}],
        "interruptionPenalty": "250",  # the annotation wins over the PriorityClass default
        "reclamationPenalty": "40",
    }
    plain = capacity_request_spec(pod("q", [ctr("1")]))
    assert plain["requirements"] == [{"key": "node.kubernetes.io/instance-type", "operator": "Exists"}]
    assert "interruptionPenalty" not in plain and plain["priority"] == 0


async def eventually(pred: Any, timeout: float = 20.0) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        v = pred()
        if v:
            return v
        if loop.time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.02)


async def test_controller_creates_one_cr_per_unschedulable_pod_and_cleans_up(tmp_path: Path) -> None:
    srv = await KubeTestServer(bookmark_interval=0.5).start()
    api = await config.new_client_from_config(config_file=str(srv.kubeconfig(tmp_path / "kc")))
    s = srv.store
    ctl = PodController(api, {"high": {"reclamationPenalty": "7"}})
    task = asyncio.create_task(ctl.run())
    try:
        p1 = s.put(pod("p1", [ctr("2", "4Gi")], priority=10, priorityClassName="high"))
        s.put(pod("scheduled", [ctr("1")], unschedulable=False))
        crs = await eventually(lambda: s.objects("capacityrequests"))
        assert len(crs) == 1
        c = crs[0]
        assert c["metadata"]["name"].startswith("cr-pod-p1-")
        assert c["metadata"]["labels"] == {OWNED_BY_POD_LABEL: p1["metadata"]["uid"]}
        assert c["metadata"]["ownerReferences"][0]["uid"] == p1["metadata"]["uid"]
        assert c["spec"]["resources"] == {"cpu": "2", "memory": "4Gi"}
        assert c["spec"]["reclamationPenalty"] == "7"
        await eventually(lambda: (s.objects("capacityrequests")[0].get("status") or {}).get("phase") == "Pending")
        # More pod events (status churn) never create a duplicate.
        for i in range(5):
            s.update_status("pods", "p1", {"phase": "Pending", "message": f"retry {i}",
                                           "conditions": p1["status"]["conditions"]}, "default")
        await eventually(lambda: ((ctl.pods.get("default", "p1") or {}).get("status") or {}).get("message")
                         == "retry 4" and not ctl.queued)
        assert len(s.objects("capacityrequests")) == 1
        # A pod that turns terminal loses its CR; a deleted pod's CR is garbage-collected.
        p2 = s.put(pod("p2", [ctr("1")]))
        await eventually(lambda: len(s.objects("capacityrequests")) == 2)
        s.update_status("pods", "p1", {"phase": "Succeeded"}, "default")
        await eventually(lambda: len(s.objects("capacityrequests")) == 1)
        s.remove("pods", "p2", "default")
        assert not [o for o in s.objects("capacityrequests")
                    if o["metadata"]["labels"][OWNED_BY_POD_LABEL] == p2["metadata"]["uid"]]
        assert ctl.created == 2 and ctl.deleted == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await api.close()
        await srv.stop()


async def test_all_pods_mode_covers_running_pods_but_not_terminal_ones(tmp_path: Path) -> None:
    srv = await KubeTestServer(bookmark_interval=0.5).start()
    api = await config.new_client_from_config(config_file=str(srv.kubeconfig(tmp_path / "kc")))
    s = srv.store
    running = pod("web", [ctr("1")], unschedulable=False)
    running["status"] = {"phase": "Running"}
    done = pod("batch", [ctr("1")], unschedulable=False)
    done["status"] = {"phase": "Succeeded"}
    s.put(running)
    s.put(done)
    ctl = PodController(api, all_pods=True)
    task = asyncio.create_task(ctl.run())
    try:
        crs = await eventually(lambda: s.objects("capacityrequests"))
        await eventually(lambda: ctl.pods.synced.is_set() and not ctl.queued)
        assert [c["metadata"]["ownerReferences"][0]["name"] for c in s.objects("capacityrequests")] == ["web"]
        assert len(crs) == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await api.close()
        await srv.stop()
