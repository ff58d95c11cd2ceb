"""`scaletest --prebind`: the seeded fleet really is the steady state of the workload's demand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bigfleet.decision import Configure, Create, Drain, EngineConfig, EngineState, decide
from bigfleet.machine import Machine, MachineState
from bigfleet.provider.fake.catalog import build_catalog
from bigfleet.provider.fake.seed import Binding, SeedStore, prebound_snapshot, read_seed, write_seed
from bigfleet.provider.kit.model import MachineRecord
from bigfleet.scale import prebind
from bigfleet.scale.workloads import cluster_id
from bigfleet.wire.machine import machine_from_proto


def _fleet_as_shard_sees_it(snapshot: dict[str, object]) -> list[Machine]:
    """Provider records → wire → the shard's Machine, the path a shard's List takes after a restart."""
    recs = [MachineRecord.from_json(d) for d in snapshot["machines"]]  # type: ignore[attr-defined]
    return [machine_from_proto(r.to_proto()) for r in recs]


@pytest.mark.parametrize(("shape", "clusters", "machines", "committed"), [
    ("aggregated", 12, 1200, 0),
    ("aggregated", 7, 900, 60),
    ("realistic", 5, 1500, 0),
])
def test_a_prebound_fleet_needs_no_binds_and_no_reclaims(shape: str, clusters: int, machines: int,
                                                         committed: int) -> None:
    bindings, plan = prebind.plan(shape, clusters, machines, committed, 0.3)
    assert bindings and plan.stats.unsatisfied == 0
    catalog = build_catalog(machines, committed, "fake")
    fleet = _fleet_as_shard_sees_it(prebound_snapshot(catalog, bindings))
    bound = [m for m in fleet if m.state is MachineState.CONFIGURED]
    assert len(bound) == len(bindings)
    assert {m.cluster for m in bound} == {cluster_id(i) for i in range(clusters)}
    assert all(m.assignment.need_fingerprint and m.assignment.priority > 0 for m in bound)
    needs = prebind.workload_needs(shape, clusters, (machines + committed) * 0.3 / clusters)
    state = EngineState(first_rollup=frozenset(cluster_id(i) for i in range(clusters)))
    d = decide(needs, fleet, 10**18, state, EngineConfig())
    assert [a for a in d.actions if isinstance(a, (Configure, Create, Drain))] == []
    assert all(v.satisfied for v in d.verdicts)
    assert d.stats.credited == len(bindings)


def test_changed_demand_needs_only_what_changed() -> None:
    bindings, _ = prebind.plan("aggregated", 10, 1000, 0, 0.3)
    fleet = _fleet_as_shard_sees_it(prebound_snapshot(build_catalog(1000, 0, "fake"), bindings))
    needs = prebind.workload_needs("aggregated", 10, 30.0)
    first = next(k for k, n in enumerate(needs) if n.cluster_id == cluster_id(3))
    n0 = needs[first]
    grown = list(needs)
    grown[first] = type(n0)(n0.cluster_id, n0.profile, n0.aggregate_resources.scale(3), n0.min_unit,
                            n0.arrival_unix_nanos)
    state = EngineState(first_rollup=frozenset(cluster_id(i) for i in range(10)))
    d = decide(grown, fleet, 10**18, state, EngineConfig())
    binds = [a for a in d.actions if isinstance(a, (Configure, Create))]
    assert binds and {a.cluster_id for a in binds} == {cluster_id(3)}
    assert not [a for a in d.actions if isinstance(a, Drain)]


def test_seed_file_round_trip_and_refusals(tmp_path: Path) -> None:
    rows = [Binding("aws-00001", "c1", {"k": "v"}), Binding("gcp-00002", "c2", {})]
    p = tmp_path / "seed.json"
    assert write_seed(p, rows) == 2
    assert read_seed(p) == rows
    for bad in ({"version": 9}, {"version": 1, "bindings": [{"id": "", "cluster": "c"}]},
                {"version": 1, "bindings": [{"id": "a", "cluster": "c", "md": {"k": 1}}]},
                {"version": 1, "bindings": [{"id": "a", "cluster": "c"}, {"id": "a", "cluster": "d"}]}):
        p.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            read_seed(p)
    catalog = build_catalog(4, 0, "fake")
    with pytest.raises(ValueError, match="not in the catalog"):
        prebound_snapshot(catalog, [Binding("nope", "c1", {})])
    with pytest.raises(ValueError):
        prebound_snapshot(catalog, [Binding(catalog[0].id, "c" * 100_000, {})])
    store = SeedStore(prebound_snapshot(catalog, [Binding(catalog[0].id, "c1", {})]))
    snap = store.load()
    assert snap is not None and store.load() is None
    first = next(d for d in snap["machines"] if d["id"] == catalog[0].id)
    assert MachineRecord.from_json(first).state is MachineState.CONFIGURED


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_prebind_real_run_starts_in_steady_state(tmp_path: Path) -> None:
    """Real fake provider + shard + load generator: with unchanged demand nothing is bound or
    reclaimed, from the first cycle to the end, and every pre-bound machine stays configured."""
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bigfleet.cli.main", "scaletest", "--prebind", "--shape", "aggregated",
         "--clusters", "8", "--machines", "800", "--demand-fraction", "0.3", "--interval", "1",
         "--change-fraction", "0",
         "--cycle-interval", "0.5", "--warmup", "3", "--duration", "4", "--workers", "1", "--json", str(out),
         "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    res = json.loads(out.read_text())
    assert res["config"]["actuate"] is True
    bound = res["prebind"]["machines_bound"]
    assert bound > 0 and res["prebind"]["plan_unsatisfied_needs"] == 0
    sh = res["shards"]["shard-1"]
    assert sh["warmup_cycles"] + sh["cycles"] >= 2 and sh["rollups_accepted"] > 0
    assert sh["first_rollup_round_actions"] == {"Configure": 0, "Create": 0, "Drain": 0, "Delete": 0}
    assert sh["warmup_actions"] == {"Configure": 0, "Create": 0, "Drain": 0, "Delete": 0}
    assert sh["binds_issued"] == 0 and sh["drains_issued"] == 0
    assert sh["inventory"]["configured"] == bound
    assert res["bootstraps_answered"] == 0


def test_catalog_machines_equal_the_shards_wire_conversion() -> None:
    from bigfleet.provider.kit.model import record_from_instance, validate_instance

    cat = build_catalog(300, 20, "fake")
    want = [machine_from_proto(record_from_instance(i, validate_instance(i)).to_proto()) for i in cat]
    got = prebind.catalog_machines(cat)
    assert got == want
    assert [m.id for m in got] == [i.id for i in cat] and len({m.id for m in got}) == len(cat)
