"""bigfleetctl's shard verbs as real processes against a real coordinator + shard + provider:
outputs are compared with what the gRPC APIs answer, and failures give the documented exit codes."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import yaml
from dashboard.fleet import Fleet, ctl, running_fleet

from bigfleet.testing import free_port, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with running_fleet() as f:
        yield f


def test_inventory_matches_get_inventory_counts(fleet: Fleet) -> None:
    # Through the coordinator (every registered shard) and directly (--shard).
    for target in (("--coordinator", fleet.coordinator), ("--shard", fleet.shard_addr)):
        out = ctl("inventory", *target, "-o", "json")
        assert out.returncode == 0, out.stderr
        rows = json.loads(out.stdout)
        assert len(rows) == 1
        want = fleet.counts()
        got = rows[0]
        assert got["total"] == want.total
        assert got["by_state"] == {k.removeprefix("MACHINE_STATE_").lower(): v for k, v in want.by_state.items()}
        assert got["bound_by_cluster"] == dict(want.bound_by_cluster) and got["bound_by_cluster"]["c1"] >= 1
        assert got["reconciled"] is True
    table = ctl("inventory", "--coordinator", fleet.coordinator)
    assert table.returncode == 0, table.stderr
    head, row = table.stdout.splitlines()[:2]
    assert head.split()[:2] == ["SHARD", "TOTAL"] and "CONFIGURED" in head
    assert row.split()[0] == "shard-a"
    by_cluster = ctl("inventory", "--coordinator", fleet.coordinator, "--by-cluster", "-o", "yaml")
    assert yaml.safe_load(by_cluster.stdout)[0]["bound_by_cluster"]["c1"] == fleet.counts().bound_by_cluster["c1"]
    # Filtered to one cluster: only its machines.
    only = json.loads(ctl("inventory", "--shard", fleet.shard_addr, "--cluster", "c1", "-o", "json").stdout)
    assert only[0]["total"] == fleet.counts("c1").total


def test_needs_for_a_cluster_found_through_the_coordinator(fleet: Fleet) -> None:
    out = ctl("needs", "--coordinator", fleet.coordinator, "--cluster", "c1", "-o", "json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["shard_id"] == "shard-a" and data["cycle"] > 0
    assert [n["cluster_id"] for n in data["needs"]] == ["c1"]
    n = data["needs"][0]
    assert n["satisfied"] is True and n["priority"] == 200
    assert n["claimed_machines"] == fleet.counts("c1").bound_by_cluster["c1"]
    assert n["resources"]["cpu"] in ("2", "2000m")

    short = json.loads(ctl("needs", "--coordinator", fleet.coordinator, "--cluster", "c2", "-o", "json").stdout)
    assert short["needs"][0]["satisfied"] is False
    assert short["needs"][0]["unmet_reason"].startswith("UNMET_REASON_")
    assert short["needs"][0]["residual_deficit"]["cpu"]

    table = ctl("needs", "--shard", fleet.shard_addr, "--unmet")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["CLUSTER", "PRIORITY", "RESOURCES"]
    assert [ln.split()[0] for ln in lines[1:-1]] == ["c2"]
    assert "2 needs" in lines[-1]


def test_shortfalls_match_list_shortfalls(fleet: Fleet) -> None:
    out = ctl("shortfalls", "--coordinator", fleet.coordinator, "-o", "json")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    want = fleet.shortfalls().shortfalls
    assert len(got) == len(want) >= 1
    assert {(r["priority"], r["shard_id"]) for r in got} == {(s.priority, "shard-a") for s in want}
    assert all(r["deficit"].get("cpu") for r in got)


def test_pause_and_resume_flip_actuation(fleet: Fleet) -> None:
    out = ctl("pause", "--coordinator", fleet.coordinator, "--shard-id", "shard-a", "--reason", "test")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("shard shard-a: paused")
    assert fleet.actuation().paused is True
    # The dashboard reuses a snapshot for up to a second, then shows the change.
    wait_until(lambda: fleet.api(fleet.shard_http)["paused"] is True, 30, what="dashboard shows paused")
    out = ctl("resume", "--shard", fleet.shard_addr, "-o", "json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["paused"] is False
    assert fleet.actuation().paused is False


def test_errors_are_clear_with_exit_codes(fleet: Fleet) -> None:
    dead = f"127.0.0.1:{free_port()}"
    r = ctl("inventory", "--shard", dead, "--timeout", "2")
    assert r.returncode == 1 and "unreachable" in r.stderr and dead in r.stderr
    r = ctl("shortfalls", "--coordinator", dead, "--timeout", "2")
    assert r.returncode == 1 and "coordinator unreachable" in r.stderr
    r = ctl("needs", "--coordinator", fleet.coordinator)
    assert r.returncode == 2 and "--cluster" in r.stderr
    r = ctl("needs", "--coordinator", fleet.coordinator, "--cluster", "nope")
    assert r.returncode == 2 and "not bound" in r.stderr
    r = ctl("pause", "--coordinator", fleet.coordinator)
    assert r.returncode == 2 and "--shard-id" in r.stderr
    r = ctl("pause", "--coordinator", fleet.coordinator, "--shard-id", "ghost")
    assert r.returncode == 2 and "ghost" in r.stderr
    r = ctl("shortfalls", "--shard", fleet.shard_addr, "--limit", "-1")
    assert r.returncode == 2
    assert fleet.actuation().paused is False


def test_coordinator_dashboard_json_matches_its_api(fleet: Fleet) -> None:
    from bigfleet.v1alpha1 import coordinator_pb2 as cpb

    assert fleet.coord is not None
    leader = fleet.coord.leader()

    def reported() -> bool:
        d = fleet.api(fleet.coord_http)
        return bool(d["shards"]) and d["shards"][0]["machines"] == fleet.counts().total and bool(d["shortfalls"])

    wait_until(reported, 30, what="the coordinator dashboard showing the shard's report")
    d = fleet.api(fleet.coord_http)
    assert d["component"] == "coordinator" and d["error"] == ""
    bindings = fleet.coord.call(leader, "ListClusterBindings", cpb.ListClusterBindingsRequest()).bindings  # type: ignore[attr-defined]
    assert sorted((c["cluster_id"], c["shard_id"]) for c in d["clusters"]) == sorted((b.cluster_id, b.shard_id) for b in bindings)
    assert [s["shard_id"] for s in d["shards"]] == ["shard-a"] and d["shards"][0]["status"] == "up"
    assert d["history"], "the sampler records points"
