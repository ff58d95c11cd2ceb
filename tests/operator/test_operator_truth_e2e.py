"""The truth inside the user's cluster, with real processes (fake provider, shard, operator) and the
k8stest API server: a demand the fleet cannot meet shows as Unsatisfied with the engine's reason and
one deduplicated Shortfall Event; a machine whose Node never registers is reported, the shard stops
counting it and provisions a replacement, which is Ready once its Node is."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import cr
from fakeshard import eventually

from bigfleet.k8stest import KubeTestServer
from bigfleet.rpc import insecure_channel
from bigfleet.testing import ManagedProcess, free_port, wait_for_health
from bigfleet.v1alpha1 import shardread_pb2, shardread_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@contextmanager
def fleet(tmp_path: Path, operator_args: tuple[str, ...] = ()) -> Iterator[tuple[KubeTestServer, dict[str, Any]]]:
    kube = KubeTestServer(bookmark_interval=1.0).start_in_thread()
    kc = kube.kubeconfig(tmp_path / "kubeconfig")
    pp, sp, mp = free_port(), free_port(), free_port()
    procs = [
        ManagedProcess.bigfleet(["fake-provider", "--listen", f"127.0.0.1:{pp}", "--seed-count", "4",
                                 "--create-delay", "0.2", "--configure-delay", "0.2", "--log-format", "console"],
                                "provider", log_dir=tmp_path),
        ManagedProcess.bigfleet(["shard", "--listen", f"127.0.0.1:{sp}", "--provider", f"127.0.0.1:{pp}",
                                 "--metrics-listen", f"127.0.0.1:{mp}", "--data-dir", str(tmp_path / "data"),
                                 "--cycle-interval", "0.3", "--min-cycle-gap", "0.05", "--reconcile-interval", "0.2",
                                 "--shard-id", "s0", "--log-format", "console"], "shard", log_dir=tmp_path),
        ManagedProcess.bigfleet(["operator", "--cluster-id", "c1", "--shard-addr", f"127.0.0.1:{sp}",
                                 "--kubeconfig", str(kc), "--namespace", "default", "--metrics-addr", "0",
                                 "--rollup-interval", "1", "--log-format", "console", *operator_args],
                                "operator", log_dir=tmp_path),
    ]
    env = {"shard": f"127.0.0.1:{sp}", "metrics": f"http://127.0.0.1:{mp}/metrics", "procs": procs}
    try:
        procs[0].start()
        procs[1].start()
        wait_for_health(f"127.0.0.1:{pp}", 60)
        wait_for_health(f"127.0.0.1:{sp}", 60)
        yield kube, env
    except BaseException:
        for p in procs:
            print(f"---- {p.name} ----\n{p.logs()[-4000:]}")
        raise
    finally:
        for p in reversed(procs):
            p.stop()
        kube.stop_thread()


def cond(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return dict(c)
    return {}


def events(kube: KubeTestServer, reason: str, name: str | None = None) -> list[dict[str, Any]]:
    return [e for e in kube.store.objects("events", "default")
            if e["reason"] == reason and (name is None or e["involvedObject"]["name"] == name)]


async def inspect(shard: str) -> dict[str, shardread_pb2.NeedView]:
    async with insecure_channel(shard) as ch:
        call = shardread_pb2_grpc.ShardReadStub(ch).InspectNeeds(shardread_pb2.InspectNeedsRequest(cluster_id="c1"),
                                                                 timeout=5)
        return {r.need.profile_fingerprint: r.need async for r in call if r.HasField("need")}


async def counts(shard: str) -> shardread_pb2.InventoryCounts:
    async with insecure_channel(shard) as ch:
        r: shardread_pb2.InventoryCounts = await shardread_pb2_grpc.ShardReadStub(ch).GetInventoryCounts(
            shardread_pb2.InventoryCountsRequest(cluster_id="c1"), timeout=5)
        return r


def alive(env: dict[str, Any]) -> None:
    for p in env["procs"]:
        assert p.alive(), f"{p.name} exited:\n{p.logs()[-3000:]}"


async def test_shortfall_shows_as_unsatisfied_with_one_deduplicated_event(tmp_path: Path) -> None:
    with fleet(tmp_path) as (kube, env):
        s = kube.store
        s.put(cr("web", {"cpu": "1"}, priority=100))
        s.put(cr("gpu", {"nvidia.com/gpu": "8"}, priority=100,
                 requirements=[{"key": "node.kubernetes.io/instance-type", "operator": "In",
                                "values": ["p5.48xlarge-does-not-exist"]}]))
        env["procs"][2].start()

        def unsatisfied() -> bool:
            alive(env)
            return cond(s.find("capacityrequests", "gpu", "default"), "Satisfied").get("status") == "False"

        await eventually(unsatisfied, timeout=90, what="gpu Unsatisfied")
        gpu = s.find("capacityrequests", "gpu", "default")
        assert gpu is not None
        assert cond(gpu, "Satisfied")["reason"] == "NoMatchingSupply"
        assert cond(gpu, "Unsatisfied") | {"lastTransitionTime": 0} == cond(gpu, "Satisfied") | {
            "type": "Unsatisfied", "status": "True", "lastTransitionTime": 0}
        assert gpu["status"]["machines"]["missing"] >= 1 and gpu["status"]["shortfall"]["since"]
        assert gpu["status"]["observedGeneration"] == gpu["metadata"]["generation"]

        def web_bound() -> bool:
            alive(env)
            web = s.find("capacityrequests", "web", "default")
            return cond(web, "Satisfied").get("status") == "True" and web["status"]["machines"]["bound"] == 1  # type: ignore[index]

        await eventually(web_bound, timeout=90, what="web Satisfied with a bound machine")
        # The operator keyed its CRs the way the shard keys its needs.
        views = await inspect(env["shard"])
        assert gpu["status"]["needFingerprint"] in views
        assert s.find("capacityrequests", "web", "default")["status"]["needFingerprint"] in views  # type: ignore[index]
        assert not views[gpu["status"]["needFingerprint"]].satisfied
        # The shortfall ages past the escalation age (5 cycles): Escalated, with its own Event.
        await eventually(lambda: cond(s.find("capacityrequests", "gpu", "default"), "Escalated").get("status") == "True",
                         timeout=60, what="Escalated")
        await eventually(lambda: events(kube, "Escalated", "gpu"), timeout=30, what="an Escalated Event")
        # Many cycles later there is still exactly one Shortfall Event for it, never repeated.
        await asyncio.sleep(4)  # more than 10 cycles
        alive(env)
        short = events(kube, "Shortfall", "gpu")
        assert len(short) == 1 and short[0]["count"] == 1, short
        assert short[0]["type"] == "Warning" and short[0]["message"].startswith("NoMatchingSupply")
        assert events(kube, "Shortfall", "web") == []
        assert cond(s.find("capacityrequests", "gpu", "default"), "Satisfied")["lastTransitionTime"] == \
            cond(gpu, "Satisfied")["lastTransitionTime"]


async def test_node_that_never_registers_is_reported_failed_and_replaced(tmp_path: Path) -> None:
    args = ("--node-readiness", "node", "--node-registration-timeout", "3s")
    with fleet(tmp_path, args) as (kube, env):
        s = kube.store
        s.put(cr("web", {"cpu": "1"}, priority=100))
        env["procs"][2].start()

        def joining() -> list[dict[str, Any]]:
            alive(env)
            return [o for o in s.objects("upcomingnodes") if (o.get("status") or {}).get("phase") == "Joining"]

        first = (await eventually(joining, timeout=90, what="a Joining UpcomingNode"))[0]  # type: ignore[index]
        bad = first["status"]["machineID"]
        # Nobody registers its Node: after 3 s it is reported; the shard fails it (stops counting it).

        def failed() -> bool:
            o = s.find("upcomingnodes", first["metadata"]["name"]) or {}
            return (o.get("status") or {}).get("phase") == "Failed"

        await eventually(failed, timeout=60, what="the UpcomingNode Failed")
        st = s.find("upcomingnodes", first["metadata"]["name"])["status"]  # type: ignore[index]
        assert st["lastError"].startswith(f"RegistrationTimeout: node {st['nodeRef']['name']} did not register within")
        ev = await eventually(lambda: events(kube, "RegistrationTimeout", first["metadata"]["name"]), timeout=30,
                              what="a RegistrationTimeout Event")
        assert ev[0]["involvedObject"]["kind"] == "UpcomingNode"  # type: ignore[index]
        c = await counts(env["shard"])
        assert c.by_state.get("MACHINE_STATE_FAILED") == 1
        metrics = urllib.request.urlopen(env["metrics"], timeout=5).read().decode()
        assert 'bigfleet_shard_registration_timeouts_total{outcome="failed"} 1.0' in metrics

        # A replacement is provisioned for the need; its Node registers and turns Ready: Ready, Satisfied.
        def replacement() -> dict[str, Any] | None:
            alive(env)
            for o in joining():
                if o["status"].get("machineID") != bad and (o["status"].get("nodeRef") or {}).get("name"):
                    return o
            return None

        rep = await eventually(replacement, timeout=60, what="a replacement machine Joining")
        node = rep["status"]["nodeRef"]["name"]  # type: ignore[index]
        s.put({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node},
               "spec": {"providerID": rep["status"].get("providerID", "")},  # type: ignore[index]
               "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
        await eventually(lambda: ((s.find("upcomingnodes", rep["metadata"]["name"]) or {}).get("status") or {})  # type: ignore[index]
                         .get("phase") == "Ready", timeout=30, what="the replacement Ready")
        await eventually(lambda: cond(s.find("capacityrequests", "web", "default"), "Satisfied").get("status") == "True"
                         and s.find("capacityrequests", "web", "default")["status"]["machines"]["bound"] == 1,  # type: ignore[index]
                         timeout=30, what="web Satisfied by the replacement")
        c = await counts(env["shard"])
        assert c.by_state.get("MACHINE_STATE_FAILED") == 1 and c.by_state.get("MACHINE_STATE_CONFIGURED") == 1
