"""bigfleetctl's error paths as real processes: a clean one-line message and the documented exit code
(docs/coordinator.md "bigfleetctl": 1 a failed call, 2 usage — unwritable files, NOT_FOUND), a quiet exit
on a closed pipe, no stray temporary file, and a rebalance hint that applies the plan it printed."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bigfleet.testing import free_port


def ctl(*args: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bigfleet.ctl.main", *args], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=60, check=False)


def ctl_into_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """Run with stdout a pipe nobody reads any more (what `| head` leaves once head exits)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return ctl(*args, stdout=w)
    finally:
        os.close(w)


def clean(r: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


DEAD = ("--coordinator", f"127.0.0.1:{free_port()}", "--timeout", "1")


def test_snapshot_destination_checked_before_the_call(tmp_path: Path) -> None:
    # An unreachable coordinator: the destination errors come first, so nothing was streamed.
    clean(ctl("snapshot", "save", str(tmp_path / "no" / "dir" / "x"), *DEAD), 2, "cannot write", "No such file")
    clean(ctl("snapshot", "save", str(tmp_path), *DEAD), 2, "cannot write", "directory")
    assert not Path(f"{tmp_path}.tmp").exists()
    # A writable destination but a failed call: exit 1 and the probe file is gone.
    clean(ctl("snapshot", "save", str(tmp_path / "snap.tar"), *DEAD), 1, "coordinator unreachable")
    assert list(tmp_path.iterdir()) == []


def test_certs_unwritable_out_is_a_usage_error(tmp_path: Path) -> None:
    clean(ctl("certs", "--out", "/proc/nope"), 2, "cannot write")
    blocker = tmp_path / "file"
    blocker.write_text("")
    clean(ctl("certs", "--out", str(blocker / "pki")), 2, "cannot write")


def test_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    r = ctl_into_closed_pipe("certs", "--out", str(tmp_path))
    assert r.returncode == 141 and r.stderr == ""


# ----------------------------------------------------------- with a coordinator
@pytest.fixture(scope="module")
def coord(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from bigfleet.coordinator.localgroup import CoordGroup
    from bigfleet.v1alpha1 import coordinator_pb2 as pb

    g = CoordGroup(tmp_path_factory.mktemp("coord"), 1, extra=("--rebalance-interval", "0"))
    g.start_all()
    try:
        leader = g.leader()
        for s in range(2):
            g.call(leader, "ReportShard", pb.ShardReport(shard_id=f"shard-{s}", shard_address=f"10.0.0.{s}:7780"))
        for c in range(24):
            g.call(leader, "LookupCluster", pb.LookupClusterRequest(cluster_id=f"c-{c}"))
        # A third shard arrives empty: a rebalance has moves, and how many depends on the load factor.
        g.call(leader, "ReportShard", pb.ShardReport(shard_id="shard-2", shard_address="10.0.0.2:7780"))
        yield g.addr(leader)
    finally:
        g.stop_all()


def plan_hint(coord: str, *opts: str) -> tuple[str, list[str]]:
    r = ctl("rebalance", "--plan", *opts, "--coordinator", coord)
    assert r.returncode == 0, r.stderr
    plan_id = r.stdout.split("plan ", 1)[1].split(":", 1)[0]
    hint = [ln for ln in r.stdout.splitlines() if ln.startswith("apply with: ")]
    assert len(hint) == 1, r.stdout
    argv = shlex.split(hint[0].removeprefix("apply with: "))
    assert argv[0] == "bigfleetctl"
    return plan_id, argv[1:]


@pytest.mark.slow
def test_rebalance_hint_repeats_the_planning_options(coord: str) -> None:
    default_id, default_cmd = plan_hint(coord)
    assert default_cmd == ["rebalance", "--apply", "--plan-id", default_id]
    plan_id, cmd = plan_hint(coord, "--load-factor", "1", "--max-moves", "50")
    assert cmd == ["rebalance", "--apply", "--max-moves", "50", "--load-factor", "1.0", "--plan-id", plan_id]
    assert plan_id != default_id, "the test needs a plan that the load factor changes"
    # What the hint says works (without --load-factor it was refused: FAILED_PRECONDITION, plan changed).
    r = ctl(*cmd, "--coordinator", coord)
    assert r.returncode == 0, r.stderr
    assert f"(plan {plan_id})" in r.stdout


@pytest.mark.slow
def test_not_found_is_a_usage_error(coord: str) -> None:
    at = ("--coordinator", coord)
    clean(ctl("transfers", "abort", "xyz", *at), 2, "NOT_FOUND", "xyz")
    clean(ctl("shards", "remove", "nope", *at), 2, "NOT_FOUND", "nope")
    clean(ctl("domains", "assign", "--key", "rack", "--value", "r1", "--shard", "nope", *at), 2, "NOT_FOUND")
    clean(ctl("needs", "--cluster", "nope", *at), 2, "not bound")
    clean(ctl("pause", "--shard-id", "nope", *at), 2, "nope")


@pytest.mark.slow
def test_snapshot_save_leaves_no_temporary_file(coord: str, tmp_path: Path) -> None:
    out = tmp_path / "snap.tar"
    r = ctl("snapshot", "save", str(out), "--coordinator", coord)
    assert r.returncode == 0 and r.stdout.startswith("saved snapshot index="), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap.tar"]
    d = tmp_path / "adir"
    d.mkdir()
    clean(ctl("snapshot", "save", str(d), "--coordinator", coord), 2, "cannot write", "directory")
    clean(ctl("snapshot", "save", str(tmp_path / "missing" / "x"), "--coordinator", coord), 2, "cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "snap.tar"]


@pytest.mark.slow
def test_listing_into_a_closed_pipe_ends_quietly(coord: str) -> None:
    r = ctl_into_closed_pipe("clusters", "--coordinator", coord)
    assert r.returncode == 141 and r.stderr == ""
