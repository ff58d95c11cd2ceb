"""Real processes: fake provider + shard (engine in its worker process, the default) + a session.
Demand converges; the engine worker is killed with SIGKILL and the shard replaces it and keeps
converging; a SIGTERM of the shard also ends its worker."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from bigfleet.v1alpha1 import provider_pb2

from .cluster import fleet
from .opsim import FakeOperator, need
from .spy import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

S = provider_pb2.MachineState


def engine_workers(parent: int) -> list[int]:
    """Live children of ``parent`` running the engine worker module."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == parent and fields[0] != "Z" and b"bigfleet.shard.engineproc" in cmd:
            out.append(int(d.name))
    return out


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


async def test_shard_converges_through_an_engine_worker_kill() -> None:
    async with fleet(("--seed-count", "6", "--committed-count", "2")) as (_prov, _spy, shard):
        proc = shard.proc
        assert proc is not None
        async with FakeOperator(shard.addr, "c1") as op:
            await op.send_rollup([need("7", count=2)])

            async def bound(n: int) -> bool:
                c = await shard.counts()
                return c.bound_by_cluster.get("c1", 0) == n and c.by_state.get("MACHINE_STATE_CONFIGURED", 0) == n

            await until(lambda: bound(2), 60, "2 machines Configured for c1")
            workers = engine_workers(proc.pid)
            assert len(workers) == 1, workers
            os.kill(workers[0], signal.SIGKILL)
            await until(lambda: gone(workers[0]) or workers[0] not in engine_workers(proc.pid), 20,
                        "the killed worker reaped")

            await op.send_rollup([need("7", count=4)])
            await until(lambda: bound(4), 60, "4 machines Configured for c1 after the worker was replaced")
            replaced = engine_workers(proc.pid)
            assert len(replaced) == 1 and replaced != workers
            assert "engine worker" in shard.logs() and "full resync" in shard.logs()
            # Verdicts came back through the worker's row diff: ShardRead shows the need satisfied.
            frames = await shard.inspect("c1")
            assert frames[0].header.total_needs == 1 and frames[1].need.satisfied

        proc.stop()
        assert all(gone(p) for p in replaced), "the engine worker outlived its shard"
