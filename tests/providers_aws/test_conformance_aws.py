"""Certification: moto's server as a real process, the AWS provider as a real process, `bigfleet conformance`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import MOTO_YAML, Moto


@pytest.mark.slow
def test_aws_provider_passes_every_conformance_lane_against_moto(moto_server: Moto, tmp_path: Path) -> None:
    moto_server.reset()
    provider = (f"{sys.executable} -m bigfleet_provider_aws --config {MOTO_YAML} --endpoint-url {moto_server.url} "
                "--listen {listen} --state-file {state_file} --seed-count {seed_count} --log-format console")
    junit = tmp_path / "conformance.xml"
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "bigfleet.cli.main", "conformance", "--lanes", "core,fault,durability,scale",
         "--provider-cmd", provider, "--scale-machines", "1000", "--scale-burst", "32", "--strict",
         # The ack budget is the kit's (default 250 ms); here the provider's boto3 threads, moto and the suite
         # share two cores with everything else CI runs, so p99 is held to 1 s (unloaded: ~90 ms).
         "--rpc-budget-ms", "1000",
         "--junit", str(junit), "--workdir", str(tmp_path / "work"), "--quiet"],
        capture_output=True, text=True, timeout=900,
    )
    took = time.monotonic() - t0
    assert p.returncode == 0, f"{p.stdout}\n{p.stderr[-3000:]}"
    summary = p.stdout.strip().splitlines()[-1]
    assert summary.endswith("0 failed, 0 skipped"), p.stdout
    assert int(summary.split()[0]) >= 45, summary
    assert junit.exists()
    print(f"conformance against moto: {summary} in {took:.1f}s")
