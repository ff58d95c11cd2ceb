"""`bigfleet all-in-one --aws-emulator` as a user runs it: one pool across the fake provider's bare metal
and the AWS provider's on-demand/spot on a local moto server; the bare metal is used first."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("moto.server")
pytest.importorskip("bigfleet_provider_aws")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_in_one_aws_emulator_pools_bare_metal_and_aws(tmp_path: Path) -> None:
    sc = tmp_path / "pool.yaml"  # 2 bare-metal hosts, demand for 4 machines of that shape
    sc.write_text("inventory: {committed: 2, speculative: 6}\n"
                  "clusters:\n  alpha:\n    - {name: web, pods: 4, cpu: 7, priority: 1000}\n")
    r = subprocess.run([sys.executable, "-m", "bigfleet.cli.main", "all-in-one", "--aws-emulator", "--scenario",
                        str(sc), "--duration", "8", "--tick", "0.5", "--print-every", "2"],
                       capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert re.search(r"providers metal 127\.0\.0\.1:\d+, aws 127\.0\.0\.1:\d+", out), out
    assert "result: OK" in out and "double-assigned machines: 0" in out, out
    pool = re.search(r"^pool: (.*)$", out, re.M)
    assert pool, out
    # Both bare-metal hosts are in use; only the remainder came from AWS (on-demand or spot).
    assert "metal bare-metal: configured 2, idle 0, in flight 0 of 2" in pool.group(1), out
    aws = [int(n) for n in re.findall(r"aws (?:on-demand|spot): configured (\d+)", pool.group(1))]
    assert len(aws) == 2 and sum(aws) == 2, out
    assert re.search(r"configured in clusters 4\b", out), out

