"""Operator benchmarks: roll-up build time, and list/ack throughput of the real client against k8stest.

`python -m bench operator`. The roll-up rows are pure CPU (build_rollup over N CapacityRequests spread over
P distinct profiles); the k8stest rows include the official client's HTTP + JSON cost on loopback and the
test server's own cost (same process, one event loop), so they are an upper bound for the client side.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from bigfleet.operator.rollup import MapCache, build_rollup


def make_crs(n: int, profiles: int) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        p = i % profiles
        out.append({
            "apiVersion": "bigfleet.lucy.sh/v1alpha1", "kind": "CapacityRequest",
            "metadata": {"name": f"cr-{i}", "namespace": f"ns-{i % 50}", "resourceVersion": "1"},
            "spec": {"priority": 1000 + (p % 7) * 100, "resources": {"cpu": f"{(i % 8) + 1}", "memory": "4Gi"},
                     "requirements": [{"key": "node.kubernetes.io/instance-type", "operator": "In",
                                       "values": [f"type-{p}"]}],
                     "interruptionPenalty": str(1 + p % 100)},
            "status": {"phase": "Acknowledged"},
        })
    return out


def bench_rollup() -> None:
    print("| CRs | profiles | needs | cold build ms (best of 3) | CRs/s | warm build ms (memo, 1% changed) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, p in [(1_000, 10), (10_000, 100), (50_000, 500), (100_000, 1_000)]:
        crs = make_crs(n, p)
        best = float("inf")
        needs = 0
        for _ in range(3):
            t0 = time.perf_counter()
            r = build_rollup("c1", crs, 0)
            best = min(best, time.perf_counter() - t0)
            needs = len(r.message.needs)
        cache = MapCache()
        build_rollup("c1", crs, 0, cache)
        for i in range(0, n, 100):  # 1% of the CRs changed since the last roll-up
            crs[i] = {**crs[i], "metadata": {**crs[i]["metadata"], "resourceVersion": "2"}}
        warm = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            build_rollup("c1", crs, 0, cache)
            warm = min(warm, time.perf_counter() - t0)
        print(f"| {n:,} | {p:,} | {needs:,} | {best * 1000:,.0f} | {n / best:,.0f} | {warm * 1000:,.0f} |")


async def bench_k8s() -> None:
    from kubernetes.aio import client, config

    from bigfleet.k8stest import KubeTestServer
    from bigfleet.operator.handlers import ClusterWriter
    from bigfleet.operator.kube import Informer
    from bigfleet.operator.metrics import OperatorMetrics

    print("\n| CRs | informer LIST+sync ms | acknowledge (status merge-patch) CRs/s |")
    print("|---:|---:|---:|")
    for n in (1_000, 5_000):
        srv = await KubeTestServer().start()
        with tempfile.TemporaryDirectory() as d:
            api = await config.new_client_from_config(config_file=str(srv.kubeconfig(Path(d) / "kc")))
            for cr in make_crs(n, 50):
                cr.pop("status")
                srv.store.put(cr)
            co = client.CustomObjectsApi(api)
            inf = Informer("crs", api, co.list_cluster_custom_object, "bigfleet.lucy.sh", "v1alpha1",
                           "capacityrequests")
            t0 = time.perf_counter()
            task = asyncio.create_task(inf.run())
            await inf.synced.wait()
            t_list = time.perf_counter() - t0
            task.cancel()
            writer = ClusterWriter(api, OperatorMetrics())
            keys = [(o["metadata"]["namespace"], o["metadata"]["name"]) for o in inf.items()][:1000]
            t0 = time.perf_counter()
            await writer.acknowledge(keys, 16)
            t_ack = time.perf_counter() - t0
            print(f"| {n:,} | {t_list * 1000:,.0f} | {len(keys) / t_ack:,.0f} |")
            await api.close()
        await srv.stop()


def main(argv: list[str]) -> int:
    bench_rollup()
    asyncio.run(bench_k8s())
    return 0


if __name__ == "__main__":
    raise SystemExit(main([]))
