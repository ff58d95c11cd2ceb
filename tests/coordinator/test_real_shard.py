"""Static stability with the real shard daemon: it reports to a 3-replica coordinator, keeps
running decision cycles while the coordinator has no quorum, and resumes reporting afterwards."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

import pytest

from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.testing import ManagedProcess, free_port, wait_for_health, wait_until
from bigfleet.v1alpha1 import coordinator_pb2 as pb

pytestmark = pytest.mark.slow


def cycles(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=3).read().decode()
    m = re.search(r"^bigfleet_shard_cycle_duration_seconds_count (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_real_shard_keeps_cycling_without_coordinator_quorum(tmp_path: Path) -> None:
    g = CoordGroup(tmp_path / "coord", 3, extra=("--rebalance-interval", "0", "--down-after", "30"))
    g.start_all()
    prov_port, shard_port, metrics_port = free_port(), free_port(), free_port()
    provider = ManagedProcess.bigfleet(
        ["fake-provider", "--listen", f"127.0.0.1:{prov_port}", "--seed-count", "4"], "provider", log_dir=tmp_path / "logs"
    )
    shard = ManagedProcess.bigfleet(
        [
            "shard", "--shard-id", "shard-real", "--listen", f"127.0.0.1:{shard_port}",
            "--provider", f"127.0.0.1:{prov_port}", "--metrics-listen", f"127.0.0.1:{metrics_port}",
            "--coordinator", ",".join(g.addresses), "--heartbeat-interval", "0.3", "--cycle-interval", "0.2",
            "--data-dir", str(tmp_path / "shard"), "--log-format", "console",
        ],
        "shard",
        log_dir=tmp_path / "logs",
    )
    provider.start()
    try:
        wait_for_health(f"127.0.0.1:{prov_port}", timeout=30)
        shard.start()
        wait_for_health(f"127.0.0.1:{shard_port}", timeout=30)
        leader = g.leader()

        def registered() -> bool:
            shards = g.call(leader, "ListShards", pb.ListShardsRequest()).shards  # type: ignore[attr-defined]
            return any(s.shard_id == "shard-real" and s.address for s in shards)

        wait_until(registered, 30, what="the real shard registered by its first report")
        reps = g.call(leader, "ListShardReports", pb.ListShardReportsRequest(shard_id="shard-real")).reports  # type: ignore[attr-defined]
        assert reps and reps[0].cycle >= 1
        wait_until(lambda: cycles(metrics_port) >= 3, 30, what="shard decision cycles")

        # No quorum: kill two of three replicas. The shard keeps cycling.
        for i in range(3):
            if i != leader:
                g.kill(i)
        c0 = cycles(metrics_port)
        wait_until(lambda: cycles(metrics_port) >= c0 + 10, 40, what="cycles while the coordinator has no quorum")
        assert shard.alive()

        # Quorum back: the shard's reports reach the (possibly new) leader again.
        for i in range(3):
            if g.procs[i] is None:
                g.start(i)
        g.wait_up()
        t_back = time.time_ns()

        def reporting_again() -> bool:
            new = g.leader(timeout=5)
            reps = g.call(new, "ListShardReports", pb.ListShardReportsRequest(shard_id="shard-real")).reports  # type: ignore[attr-defined]
            return bool(reps) and reps[0].received_at_unix_ns > t_back

        wait_until(reporting_again, 40, what="shard reports resuming")
    finally:
        shard.stop()
        provider.stop()
        g.stop_all()
