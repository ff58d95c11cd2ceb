"""bigfleetctl against a real 3-replica coordinator; snapshot save → offline restore → identical state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.ctl.main import main as ctl
from bigfleet.v1alpha1 import coordinator_pb2 as pb

pytestmark = pytest.mark.slow


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = ctl(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def state_of(g: CoordGroup, i: int) -> dict[str, object]:
    shards = g.call(i, "ListShards", pb.ListShardsRequest()).shards  # type: ignore[attr-defined]
    binds = g.call(i, "ListClusterBindings", pb.ListClusterBindingsRequest()).bindings  # type: ignore[attr-defined]
    doms = g.call(i, "ListDomainAssignments", pb.ListDomainAssignmentsRequest()).assignments  # type: ignore[attr-defined]
    return {
        "shards": [(s.shard_id, s.address, s.registered_at_unix_ns) for s in shards],
        "bindings": [(b.cluster_id, b.shard_id, b.binding_epoch) for b in binds],
        "domains": [(d.topology_key, d.topology_value, d.shard_id) for d in doms],
    }


def test_ctl_commands_snapshot_and_restore(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    g = CoordGroup(tmp_path / "a", 3, extra=("--rebalance-interval", "0"))
    g.start_all()
    restored: CoordGroup | None = None
    try:
        leader = g.leader()
        follower = next(i for i in range(3) if i != leader)
        for s in range(3):
            g.call(leader, "ReportShard", pb.ShardReport(shard_id=f"shard-{s}", shard_address=f"10.0.0.{s}:7780"))
        # Pointing at a follower only still works: the client follows the leader hint
        # (members register their addresses shortly after start).
        from bigfleet.testing import wait_until

        coord = g.addr(follower)
        wait_until(lambda: ctl(["lookup", "c-0", "--coordinator", coord, "-o", "json"]) == 0, 20, what="leader hint")
        capsys.readouterr()
        all_addrs = ",".join(g.addresses)
        for c in range(1, 20):
            assert run(capsys, "lookup", f"c-{c}", "--coordinator", all_addrs)[0] == 0
        rc, out, _ = run(capsys, "shards", "--coordinator", coord)
        assert rc == 0 and out.splitlines()[0].split()[:3] == ["SHARD", "ADDRESS", "STATUS"]
        assert "shard-2" in out and " up " in out
        rc, out, _ = run(capsys, "clusters", "-o", "json", "--coordinator", coord)
        rows = json.loads(out)
        assert rc == 0 and len(rows) == 20 and {r["shard_id"] for r in rows} <= {"shard-0", "shard-1", "shard-2"}
        rc, out, _ = run(capsys, "domains", "assign", "--key", "rack", "--value", "r7", "--shard", "shard-1", "--coordinator", coord)
        assert rc == 0 and "assigned rack=r7 → shard-1" in out
        rc, _, err = run(capsys, "domains", "assign", "--key", "rack", "--value", "r7", "--shard", "shard-2", "--coordinator", coord)
        assert rc == 1 and "ALREADY_EXISTS" in err
        rc, out, _ = run(capsys, "domains", "-o", "yaml", "--coordinator", coord)
        assert yaml.safe_load(out) == [{"shard_id": "shard-1", "topology_key": "rack", "topology_value": "r7"}]
        # A 4th shard arrives: the plan moves clusters mostly to it (with 20 clusters a few
        # that the cap displaced early on may also return to their preferred shard).
        g.call(leader, "ReportShard", pb.ShardReport(shard_id="shard-3", shard_address="10.0.0.3:7780"))
        rc, out, _ = run(capsys, "rebalance", "--plan", "-o", "json", "--coordinator", coord)
        plan = json.loads(out)
        assert rc == 0 and plan["total_clusters"] == 20 and plan["live_shards"] == 4
        to_new = sum(1 for m in plan["moves"] if m["to"] == "shard-3")
        assert to_new >= 1 and to_new >= len(plan["moves"]) / 2
        assert max(plan["load_after"].values()) <= 6  # cap(20, 4) = max(5, floor(1.25 * 5))
        rc, out, _ = run(capsys, "rebalance", "--plan", "--coordinator", coord)
        assert f"plan {plan['plan_id']}" in out
        rc, _, err = run(capsys, "rebalance", "--apply", "--plan-id", "deadbeef", "--coordinator", coord)
        assert rc == 1 and "plan changed" in err
        rc, out, _ = run(capsys, "transfers", "--coordinator", coord)
        assert rc == 0 and out.strip() == "(none)"
        rc, _, err = run(capsys, "transfers", "abort", "nope", "--coordinator", coord)
        assert rc == 2 and "NOT_FOUND" in err  # an unknown id is a usage error, as for the shard verbs
        assert run(capsys, "shards", "remove", "nope", "--coordinator", coord)[0] == 2

        before = state_of(g, leader)
        archive = tmp_path / "snap.tar"
        rc, out, _ = run(capsys, "snapshot", "save", str(archive), "--coordinator", coord)
        assert rc == 0 and out.startswith("saved snapshot index=")
        old_term = g.call(leader, "ReportShard", pb.ShardReport(shard_id="shard-0")).coordinator_term  # type: ignore[attr-defined]
        g.stop_all()

        # Offline restore into a fresh data dir, started as a single voter.
        restored = CoordGroup(tmp_path / "b", 1, extra=("--rebalance-interval", "0"))
        r = subprocess.run(
            [sys.executable, "-m", "bigfleet.cli.main", "coordinator", "restore", "--archive", str(archive), "--data-dir", str(restored.data_dir(0))],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        restored.start(0)
        restored.leader()
        wait_until(lambda: state_of(restored, 0) == before, 20, what="restored state")
        new_term = restored.call(0, "ReportShard", pb.ShardReport(shard_id="shard-0")).coordinator_term  # type: ignore[attr-defined]
        assert new_term > old_term, "the coordinator term must not regress across a restore (shards fence on it)"
        # A corrupt archive is refused with a clear error.
        bad = tmp_path / "bad.tar"
        bad.write_bytes(b"not a tar")
        r = subprocess.run(
            [sys.executable, "-m", "bigfleet.cli.main", "coordinator", "restore", "--archive", str(bad), "--data-dir", str(tmp_path / "c")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 1 and "restore failed" in r.stderr
    finally:
        g.stop_all()
        if restored is not None:
            restored.stop_all()


def test_ctl_reports_an_unreachable_coordinator(capsys: pytest.CaptureFixture[str]) -> None:
    from bigfleet.testing import free_port

    rc, _, err = run(capsys, "clusters", "--coordinator", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert rc == 1 and "coordinator unreachable" in err
