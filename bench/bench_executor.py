"""Executor throughput: Create+Configure flows per second against a real fake-provider process.

The shard's executor runs in this process (view, provider client, instant in-process bootstrap
answers: no operator, no engine), so the figures are the executor's and the provider's own cost
per bind: flows/s, RPCs per flow, CPU seconds per 1 000 flows on each side.

    python -m bench.bench_executor --machines 5000 --concurrency 256
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time
from typing import Any

from bigfleet.observability import new_registry
from bigfleet.process.procstat import proc_cpu_seconds
from bigfleet.shard.executor import Binding, Executor, ExecutorConfig
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.provider_client import ProviderClient
from bigfleet.shard.sessions import BootstrapResult, SessionRegistry
from bigfleet.shard.view import MachineView
from bigfleet.testing import ManagedProcess, free_port, wait_for_health


class _Session:
    async def request_bootstrap(self, requirements: list[Any], timeout: float) -> BootstrapResult:
        return BootstrapResult(b"#cloud-config\n", 3600, "")


class _Sessions(SessionRegistry):
    def __init__(self) -> None:
        super().__init__()
        self.one = _Session()

    def get(self, cluster_id: str) -> Any:
        return self.one


def _binding(i: int) -> Binding:
    return Binding(f"c{i % 50}", f"fp-{i % 150}", 100, 64.0, 64.0, ())


async def run(machines: int, concurrency: int, watch: bool, channels: int, profile: str,
              target: str = "", provider_pid: int = 0) -> dict[str, float]:
    addr = target or f"127.0.0.1:{free_port()}"
    prov = None if target else ManagedProcess.bigfleet(
        ["fake-provider", "--listen", addr, "--seed-count", str(machines), "--log-level", "warning"],
        "bench-provider").start()
    try:
        wait_for_health(addr, timeout=120)
        metrics = ShardMetrics(new_registry())
        kw: dict[str, Any] = {"channels": channels} if channels > 1 else {}
        client = ProviderClient(addr, "bench", 1, metrics, **kw)
        view = MachineView()
        for pb in (await client.list()).machines:
            view.set(pb)
        ids = sorted(pb.id for pb in view.all())
        ex = Executor(view, client, _Sessions(), lambda c, fp, p: _binding(0), ExecutorConfig(
            concurrency=concurrency, watch=watch, execute_timeout=120.0), metrics)
        pid = prov.proc.pid if prov is not None and prov.proc else provider_pid
        p0, c0, t0 = proc_cpu_seconds(pid), time.process_time(), time.perf_counter()
        prof = cProfile.Profile() if profile else None
        if prof:
            prof.enable()
        for i, mid in enumerate(ids):
            ex.submit_create(mid, _binding(i))
        while view.inflight:
            await asyncio.sleep(0.05)
        if prof:
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").dump_stats(profile)
        wall = time.perf_counter() - t0
        shard_cpu, prov_cpu = time.process_time() - c0, proc_cpu_seconds(pid) - p0
        configured = sum(1 for pb in view.all() if pb.state == 5)
        rpc = {}
        for m in metrics.provider_rpc.collect():
            for s in m.samples:
                if s.name.endswith("_count"):
                    rpc[s.labels["rpc"]] = s.value
        await client.close()
        return {"flows": len(ids), "configured": configured, "wall_s": wall, "flows_per_s": len(ids) / wall,
                "shard_cpu_s_per_1k": 1000 * shard_cpu / len(ids), "provider_cpu_s_per_1k": 1000 * prov_cpu / len(ids),
                "shard_cores": shard_cpu / wall, "provider_cores": prov_cpu / wall,
                **{f"rpc_{k}_per_flow": v / len(ids) for k, v in sorted(rpc.items())}}
    finally:
        if prov is not None:
            prov.stop()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bench_executor", description=__doc__)
    p.add_argument("--machines", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--poll", action="store_true", help="per-machine Get polling instead of the shared List")
    p.add_argument("--channels", type=int, default=1)
    p.add_argument("--profile", default="", help="write a cProfile of the executor side here")
    p.add_argument("--target", default="", help="use this running provider (seeded with --machines) instead")
    p.add_argument("--provider-pid", type=int, default=0, help="its pid, for its CPU figure")
    args = p.parse_args(argv)
    res = asyncio.run(run(args.machines, args.concurrency, not args.poll, args.channels, args.profile,
                          args.target, args.provider_pid))
    print(f"executor: {args.machines} Create+Configure flows, concurrency {args.concurrency}, "
          f"{'Get polling' if args.poll else 'shared List watch'}, channels {args.channels}")
    print("| figure | value |\n|---|---|")
    for k, v in res.items():
        print(f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |")
    return 0 if res["configured"] == res["flows"] else 1


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
