"""Scale harness: pure shapes and statistics, and one tiny real-process run of `bigfleet scaletest`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bigfleet.scale import stats
from bigfleet.scale.workloads import SHAPES, UNIT_MILLI, cluster_id, rollup_needs
from bigfleet.v1alpha1 import capacity_pb2
from bigfleet.wire.needs import rollup_from_proto


def _cpu_milli(n: capacity_pb2.CapacityNeed) -> int:
    return int(n.aggregate_resources["cpu"].removesuffix("m"))


def test_uber5k_matches_the_upstream_cardinality() -> None:
    per = [rollup_needs("uber-5k", c, 250.0) for c in range(20)]
    total = sum(len(p) for p in per)
    gangs = sum(1 for p in per for n in p if n.group)
    assert total == 2580
    assert 0.92 <= gangs / total <= 0.94
    for p in per:
        for n in p:
            same = [r for r in n.requirements if r.operator == capacity_pb2.NodeSelectorRequirement.OPERATOR_SAME]
            assert bool(same) == bool(n.group)


@pytest.mark.parametrize("shape", SHAPES)
def test_shapes_are_sized_deterministic_and_valid(shape: str) -> None:
    a = rollup_needs(shape, 7, 400.0)
    assert a == rollup_needs(shape, 7, 400.0)
    machines = sum(_cpu_milli(n) for n in a) / UNIT_MILLI
    assert 300 <= machines <= 520  # rounding to whole units per need
    # every roll-up the harness sends passes the shard's own wire validation
    cid, needs = rollup_from_proto(capacity_pb2.ClusterCapacityNeeds(cluster_id=cluster_id(7), needs=a), 1)
    assert cid == cluster_id(7) and len(needs) == len(a)


def test_a_variant_changes_exactly_one_need() -> None:
    base = rollup_needs("realistic", 3, 200.0)
    changed = rollup_needs("realistic", 3, 200.0, variant=5)
    diffs = [i for i, (x, y) in enumerate(zip(base, changed, strict=True)) if x != y]
    assert len(diffs) == 1


def test_unknown_shape_is_refused() -> None:
    with pytest.raises(ValueError):
        rollup_needs("nope", 0, 10.0)


TEXT0 = """# TYPE h histogram
h_bucket{le="0.1",phase="a"} 1
h_bucket{le="1.0",phase="a"} 1
h_bucket{le="+Inf",phase="a"} 1
h_count{phase="a"} 1
h_sum{phase="a"} 0.05
# TYPE c counter
c_total{kind="Configure"} 5
"""
TEXT1 = TEXT0.replace('"0.1",phase="a"} 1', '"0.1",phase="a"} 2').replace(
    '"1.0",phase="a"} 1', '"1.0",phase="a"} 11').replace('"+Inf",phase="a"} 1', '"+Inf",phase="a"} 11').replace(
    "c_total{kind=\"Configure\"} 5", "c_total{kind=\"Configure\"} 9")


def test_window_quantiles_and_deltas() -> None:
    b, a = stats.parse(TEXT0), stats.parse(TEXT1)
    # in the window: 1 observation <= 0.1, 9 in (0.1, 1.0]
    assert stats.histogram_quantile(a, b, "h", 0.1, phase="a") == 0.1
    assert stats.histogram_quantile(a, b, "h", 0.5, phase="a") == 1.0
    assert math.isnan(stats.histogram_quantile(a, a, "h", 0.5, phase="a"))
    assert stats.delta(a, b, "c_total", kind="Configure") == 4
    assert stats.quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert stats.per_cycle_peaks([(0, 0), (1, 7), (3, 9), (4, 20)]) == (11.0, (7 + 1 + 11) / 3)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tiny_real_run_reports_cycles_acks_and_binds(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bigfleet.cli.main", "scaletest", "--shape", "uber-5k", "--clusters", "4",
         "--machines", "1200", "--demand-fraction", "0.5", "--interval", "1", "--cycle-interval", "1",
         "--warmup", "3", "--duration", "6", "--workers", "2", "--actuate", "--json", str(out),
         "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    assert "| shard-1 cycle_p99_s_le |" in proc.stdout
    res = json.loads(out.read_text())
    assert res["sessions_open"] == 4
    assert res["rollups_measured"] > 0 and res["rollup_ack_p99_ms"] > 0
    sh = res["shards"]["shard-1"]
    assert sh["sessions"] == 4
    assert sh["cycles"] >= 1 and sh["cycle_p99_s_le"] > 0
    assert sh["rollups_accepted"] > 0
    # demand is half the inventory: machines were bound (through bootstraps the sessions answered)
    assert res["bootstraps_answered"] > 0
    assert sh["inventory"].get("configured", 0) + sh["inventory"].get("configuring", 0) > 0
    # Provider RPC rates cover the measured window only: every Configure may land in the warm-up
    # (the configured machines above prove they happened), so the window's rate may be 0.
    assert "Configure" in sh["provider_rpcs_per_s"], sh["provider_rpcs_per_s"]
    assert sh["provider_rpcs_per_s"]["List"] > 0
    assert sh["rss_max_mb"] > 0 and sh["cpu_cores"] > 0
