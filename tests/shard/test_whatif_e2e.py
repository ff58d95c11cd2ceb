"""`bigfleetctl whatif` (and `consolidation --plan`) as a real process against a real shard process and
fake provider: the CapacityRequest file is answered per need (table and JSON), and the shard calls no
provider lifecycle RPC for it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .cluster import fleet
from .spy import until

pytestmark = pytest.mark.slow

REQUESTS = """\
apiVersion: bigfleet.lucy.sh/v1alpha1
kind: CapacityRequest
metadata: {name: web-0, namespace: shop}
spec: {priority: 100, resources: {cpu: "1"}}
---
apiVersion: bigfleet.lucy.sh/v1alpha1
kind: CapacityRequest
metadata: {name: web-1, namespace: shop}
spec: {priority: 100, resources: {cpu: "1"}}
---
apiVersion: bigfleet.lucy.sh/v1alpha1
kind: CapacityRequest
metadata: {name: giant, namespace: shop}
spec: {priority: 50, resources: {cpu: "5000"}}
"""

LIFECYCLE = {"Create", "Configure", "Drain", "Delete"}


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bigfleet.ctl.main", *args], capture_output=True, text=True,
                          timeout=60, check=False)


async def test_whatif_cli_against_a_real_shard() -> None:
    async with fleet(("--seed-count", "2", "--committed-count", "2"), ("--engine-mode", "inline")) as (_p, spy, shard):
        async def reconciled() -> bool:
            return (await shard.counts()).reconciled
        await until(reconciled, 60, "shard reconciled")
        await shard.wait_cycles(1)
        f = Path(tempfile.mkdtemp()) / "req.yaml"
        f.write_text(REQUESTS)
        calls = len(spy.calls)
        out = await asyncio.to_thread(ctl, "whatif", "-f", str(f), "--cluster", "c1", "--shard", shard.addr,
                                      "-o", "json")
        assert out.returncode == 0, out.stderr + shard.logs()[-3000:]
        data = json.loads(out.stdout)
        small, giant = data["answers"]
        assert small["requests"] == ["shop/web-0", "shop/web-1"] and small["resources"]["cpu"] in ("2", "2000m")
        assert small["satisfiable"] and small["outcome"] in ("idle", "speculative")
        assert small["idle"] + small["speculative"] >= 1
        assert giant["requests"] == ["shop/giant"] and not giant["satisfiable"]
        assert giant["unmet_reason"].startswith("UNMET_REASON_") and giant["residual_deficit"]["cpu"]
        assert data["all_satisfiable"] is False
        table = await asyncio.to_thread(ctl, "whatif", "-f", str(f), "--cluster", "c1", "--shard", shard.addr)
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0].split()[:3] == ["NEED", "REQUESTS", "PRIORITY"] and "UNSATISFIABLE" in lines[2]
        assert "nothing was changed" in lines[-1]
        # Nothing was actuated for the what-if (no demand exists, so no cycle acts either).
        assert not [n for n, _ in spy.calls[calls:] if n in LIFECYCLE]
        assert (await shard.counts()).by_state.get("MACHINE_STATE_CONFIGURED", 0) == 0
        # consolidation --plan: no demand, so no move; the verb reaches the shard and says so.
        plan = await asyncio.to_thread(ctl, "consolidation", "--plan", "--shard", shard.addr, "-o", "json")
        assert plan.returncode == 0 and json.loads(plan.stdout) == [], plan.stderr
        plan = await asyncio.to_thread(ctl, "consolidation", "--plan", "--shard", shard.addr)
        assert plan.returncode == 0 and "nothing was changed" in plan.stdout, plan.stderr
        assert (await asyncio.to_thread(ctl, "consolidation", "--shard", shard.addr)).returncode == 2
        # Bad input: INVALID_ARGUMENT surfaces as a usage error (exit 2) naming the field.
        f.write_text("clusterId: c1\nneeds:\n- aggregateResources: {cpu: lots}\n")
        bad = await asyncio.to_thread(ctl, "whatif", "-f", str(f), "--shard", shard.addr)
        assert bad.returncode == 2 and "aggregate_resources" in bad.stderr
