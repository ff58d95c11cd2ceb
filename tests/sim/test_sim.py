"""The simulator drives the real shard; these tests check the scenarios' outcomes and the checker itself."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from bigfleet.machine.state import MachineState
from bigfleet.provider.kit.model import State
from bigfleet.sim import InvariantChecker, ScenarioError, Simulator, builtin, load
from bigfleet.sim.__main__ import GOLDEN, SETTLE, golden_trace, soak_config
from bigfleet.sim.scenario import BUILTIN, KNOWN_ISSUES, RACK_LABEL, Scenario, from_dict

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"


def _run(name: str) -> tuple[Simulator, object]:
    sim = Simulator(builtin(name), settle_cycles=SETTLE)
    return sim, sim.run()


def _states(sim: Simulator) -> Counter[State]:
    return Counter(State(int(m.state)) for m in sim.provider.core.machines.values())


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_ISSUES[n])) if n in KNOWN_ISSUES else n
    for n in sorted(BUILTIN)
])
def test_builtin_scenarios_hold_every_invariant(name: str) -> None:
    sim, res = _run(name)
    assert res.violations == [], "\n".join(map(str, res.violations))  # type: ignore[attr-defined]
    assert not sim.shard.view.inflight


def test_withdrawal_releases_down_to_the_remaining_demand() -> None:
    sim, res = _run("withdrawal")
    bound = Counter(m.cluster for m in sim.provider.core.machines.values() if m.state == State.CONFIGURED)
    # a: 2 pods x 3 cpu = one 8-vCPU machine; b's jobs completed and withdrew
    assert bound == Counter({"a": 1})
    assert res.totals["Drain"] >= 10 and res.reclaims >= 10  # type: ignore[attr-defined]


def test_priority_spike_preempts_the_low_priority_cluster() -> None:
    sim, res = _run("priority-inversion")
    bound = Counter(m.cluster for m in sim.provider.core.machines.values() if m.state == State.CONFIGURED)
    assert bound == Counter({"high": 4})
    drains = [json.loads(line) for line in res.trace if '"Drain"' in line]  # type: ignore[attr-defined]
    reasons = {a["reason"] for d in drains for a in d["actions"] if a["kind"] == "Drain"}
    assert reasons == {"preempt"}


def test_stockout_is_a_stable_shortfall_without_overprovisioning() -> None:
    sim, res = _run("capacity-stockout")
    assert _states(sim) == Counter({State.CONFIGURED: 5})
    last = json.loads(res.trace[-1])  # type: ignore[attr-defined]
    assert last["shortfalls"] >= 1 and last["actions"] == []


def test_failed_transitions_end_failed_with_a_reason_and_demand_is_served_elsewhere() -> None:
    sim, _ = _run("provider-configure-failure")
    failed = [m for m in sim.provider.core.machines.values() if m.state == State.FAILED]
    assert failed and all(m.last_error for m in failed)
    assert all(sim.shard.view.get(m.id).last_error for m in failed)  # type: ignore[union-attr]
    assert _states(sim)[State.CONFIGURED] == 2  # everything left after the fault window


def test_hung_creates_are_failed_by_the_shard_within_its_timeout() -> None:
    sim, _ = _run("hang-and-disconnect")
    shown = [pb for pb in sim.shard.view.all() if MachineState(int(pb.state)) == MachineState.FAILED]
    assert shown and all("timed out" in pb.last_error for pb in shown)
    # cluster b was cut off and came back: it is served again
    bound = Counter(m.cluster for m in sim.provider.core.machines.values() if m.state == State.CONFIGURED)
    assert bound["b"] + bound["a"] == 2


def test_gang_lands_on_one_rack_and_withdraws_when_done() -> None:
    sim, res = _run("training-job-topology")
    configures = [a for line in res.trace for a in json.loads(line).get("actions", ())  # type: ignore[attr-defined]
                  if a["kind"] == "Configure"]
    racks = {sim.provider.core.machines[a["machine"]].labels[RACK_LABEL] for a in configures}
    assert len(configures) == 3 and len(racks) == 1
    assert _states(sim)[State.CONFIGURED] == 0  # the job completed and withdrew


def test_gang_beside_service_keeps_each_needs_machines() -> None:
    """A service and a rack gang in one cluster: no need swapping. 2 web + 3 gang machines are configured
    once each; the only drains are the gang's 3 machines after the job withdraws."""
    _, res = _run("gang-beside-service")
    assert res.violations == []  # type: ignore[attr-defined]
    assert res.totals["Configure"] == 5 and res.totals["Drain"] == 3  # type: ignore[attr-defined]


def test_same_seed_same_trace() -> None:
    a = Simulator(builtin("mixed-fleet")).run()
    b = Simulator(builtin("mixed-fleet")).run()
    assert a.trace == b.trace and a.final_states == b.final_states


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_trace_unchanged(name: str) -> None:
    """Regenerate on purpose only: `python -m bigfleet.sim record` and review the diff."""
    assert golden_trace(name) == (GOLDEN_DIR / f"{name}.jsonl").read_text()


@pytest.mark.slow
def test_short_soak_with_churn_and_failures_ends_settled() -> None:
    res = Simulator(soak_config(400, clusters=8), settle_cycles=30).run()
    assert res.violations == [], "\n".join(map(str, res.violations))
    assert res.totals["Configure"] > 100 and res.totals["Drain"] > 100


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_soak_10k_cycles() -> None:
    from bigfleet.sim.__main__ import rss_bytes

    marks: list[int] = []

    def on_cycle(st: object) -> None:
        if getattr(st, "cycle", 0) in (1000, 9999):
            marks.append(rss_bytes())

    res = Simulator(soak_config(10_000), settle_cycles=30, on_cycle=on_cycle, keep_trace=False).run()
    assert res.violations == [], "\n".join(map(str, res.violations))
    assert len(marks) == 2 and marks[1] - marks[0] < 64 * 2**20, marks


# -- the checker catches what it claims to catch ---------------------------------------------------


def _fake(machines: dict[str, SimpleNamespace]) -> tuple[SimpleNamespace, SimpleNamespace]:
    provider = SimpleNamespace(core=SimpleNamespace(machines=machines))
    view = SimpleNamespace(
        ids=lambda: list(machines), all=lambda: [], get=lambda _m: None, inflight={}, reserved_for={},
    )
    return provider, view


def _m(state: State, cluster: str = "", err: str = "") -> SimpleNamespace:
    return SimpleNamespace(state=state, cluster=cluster, last_error=err, shard_metadata={})


def _checker(total: int) -> InvariantChecker:
    return InvariantChecker(total_machines=total, execute_timeout=10, provider_timeout=30, cycle_seconds=2,
                            reclaim_cap_fraction=0.05)


def test_checker_flags_an_illegal_transition() -> None:
    c = _checker(1)
    c.transition("m", int(State.SPECULATIVE), int(State.CONFIGURED))
    assert [v.rule for v in c.violations] == ["legal-transition"]
    c2 = _checker(1)
    c2.transition("m", int(State.SPECULATIVE), int(State.CREATING))
    c2.transition("m", -1, int(State.IDLE))
    assert c2.violations == []


def test_checker_flags_a_lost_machine_and_a_failed_machine_without_reason() -> None:
    c = _checker(3)
    provider, view = _fake({"a": _m(State.IDLE), "b": _m(State.FAILED)})
    c.after_cycle(0, 0.0, provider, view, {}, Counter())
    assert {v.rule for v in c.violations} == {"inventory-conserved", "failed-has-reason"}


def test_checker_flags_overprovisioning_but_allows_the_reclaim_lag() -> None:
    c = _checker(4)
    ms = {f"m{i}": _m(State.CONFIGURED, "a") for i in range(4)}
    provider, view = _fake(ms)
    c.after_cycle(0, 0.0, provider, view, {"a": 4}, Counter())
    c.after_cycle(1, 2.0, provider, view, {"a": 1}, Counter())  # demand dropped: lag allowance
    assert c.violations == []
    for cycle in range(2, 12):  # never reclaimed
        c.after_cycle(cycle, 2.0 * cycle, provider, view, {"a": 1}, Counter())
    assert c.violations and c.violations[0].rule == "no-overprovision"


def test_checker_flags_creates_beyond_a_need_and_a_node_in_two_clusters() -> None:
    c = _checker(3)
    provider, view = _fake({f"m{i}": _m(State.CREATING) for i in range(3)})
    for i in range(3):
        provider.core.machines[f"m{i}"].shard_metadata = {"bigfleet.lucy.sh/assigned-need-fingerprint": "fp1"}
        view.reserved_for[f"m{i}"] = "a"
    c.after_cycle(0, 0.0, provider, view, {"a": 5}, Counter(), need_bounds={("a", "fp1"): 2},
                  cluster_nodes={"a": {"x": int(State.CONFIGURED)}, "b": {"x": int(State.CONFIGURED)}})
    assert sorted(v.rule for v in c.violations) == ["no-double-create", "one-cluster"], c.violations


def test_checker_flags_a_machine_stuck_in_a_transition() -> None:
    c = _checker(1)
    provider, view = _fake({"m": _m(State.CREATING)})
    c.after_cycle(0, 0.0, provider, view, {}, Counter())
    c.after_cycle(1, 100.0, provider, view, {}, Counter())
    assert [v.rule for v in c.violations] == ["stuck-transitional"]


# -- scenario files ----------------------------------------------------------------------------------


def test_scenario_yaml_round_trip_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "s.yaml"
    f.write_text(
        "cycles: 20\ninventory: {committed: 4, speculative: 4}\n"
        "clusters:\n  a:\n    - {name: web, pods: 4, cpu: 2, priority: 1000}\n"
        "faults:\n  - {at: 3, kind: fail, kinds: [create]}\n  - {at: 6, kind: clear}\n"
    )
    sc = load(f)
    assert sc.name == "s" and sc.committed == 4 and sc.clusters["a"][0].pods == 4
    res = Simulator(sc, settle_cycles=5).run()
    assert res.ok
    with pytest.raises(ScenarioError, match="unknown keys"):
        from_dict({"clusters": {"a": []}, "cylces": 3})
    with pytest.raises(ScenarioError, match="fault kind"):
        from_dict({"clusters": {"a": []}, "faults": [{"at": 1, "kind": "explode"}]})
    with pytest.raises(ScenarioError, match="clusters"):
        from_dict({"cycles": 3})
    with pytest.raises(ScenarioError, match="unknown scenario"):
        builtin("nope")


# -- the checker catches broken shard behaviour inside the closed loop (mutations of the real code) --


def test_loop_flags_overprovisioning_when_reclaims_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    from collections.abc import Mapping
    from dataclasses import replace

    from bigfleet.decision.types import Decision, Drain
    from bigfleet.shard.dispatch import Dispatcher

    real = Dispatcher.dispatch

    async def no_reclaims(self: Dispatcher, decision: Decision, counts: Mapping[str, int] | None = None) -> None:
        kept = tuple(a for a in decision.actions if not (isinstance(a, Drain) and a.reason == "reclaim"))
        await real(self, replace(decision, actions=kept), counts)

    monkeypatch.setattr(Dispatcher, "dispatch", no_reclaims)
    res = Simulator(builtin("withdrawal"), settle_cycles=SETTLE).run()
    assert "no-overprovision" in {v.rule for v in res.violations}


def test_loop_flags_a_shard_that_leaves_a_timed_out_machine_unfailed(monkeypatch: pytest.MonkeyPatch) -> None:
    from bigfleet.shard.executor import Executor

    monkeypatch.setattr(Executor, "_fail", lambda self, mid, err: None)
    res = Simulator(builtin("hang-and-disconnect"), settle_cycles=SETTLE).run()
    assert "stuck-transitional" in {v.rule for v in res.violations}


def test_loop_flags_a_shard_that_forgets_a_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    from bigfleet.shard.reconcile import Reconciler

    real = Reconciler.reconcile

    async def lossy(self: Reconciler, full: bool = False) -> None:
        await real(self, full)
        ids = sorted(self.view.ids())
        if ids and self.count == 6:  # (the first List, then one per cycle: around cycle 5)
            self.view.forget(ids[0])

    monkeypatch.setattr(Reconciler, "reconcile", lossy)
    res = Simulator(builtin("withdrawal"), settle_cycles=SETTLE).run()
    assert "inventory-conserved" in {v.rule for v in res.violations}


# -- no double create counts Creates per machine lifetime --------------------------------------------


def _released_and_recreated() -> Scenario:
    """Machines serve a job, are reclaimed, released (deleted back to Speculative) after their idle
    hold, and created again for a second job much later: one Create per lifetime, never a double."""
    from bigfleet.sim.scenario import Dwells, Workload

    # 30 s cycles: the on-demand hold (10 min) passes in 20 cycles; a create outlasts a cycle, so the
    # checker sees the second lifetime's machine CREATING
    return Scenario("released-and-recreated", cycles=80, committed=0, speculative=2, cycle_seconds=30.0,
                    execute_timeout=120.0, dwell=Dwells(create=45.0), clusters={
        "a": (Workload("etl", pods=2, cpu=7.0, priority=100, spot_ok=True, stop=8),
              Workload("etl-again", pods=2, cpu=7.0, priority=100, spot_ok=True, start=65)),
    })


def test_a_machine_created_again_in_a_new_lifetime_is_not_a_double_create() -> None:
    sim = Simulator(_released_and_recreated(), settle_cycles=SETTLE)
    res = sim.run()
    again = [mid for mid, n in sim.stub.creates_started.items() if n >= 2]
    assert again, "the scenario must create some machine twice (two lifetimes)"
    assert res.violations == [], "\n".join(map(str, res.violations))


def test_checker_still_flags_two_creates_in_one_lifetime() -> None:
    c = _checker(1)
    provider, view = _fake({"m": _m(State.CREATING)})
    c.after_cycle(0, 0.0, provider, view, {}, Counter({"m": 2}))
    assert [v.rule for v in c.violations] == ["no-double-create"]


def test_stub_counts_creates_per_lifetime() -> None:
    from bigfleet.sim.harness import RecordingStub

    stub = RecordingStub.__new__(RecordingStub)
    stub.creates_started, stub.lifetime_creates = Counter(), Counter()
    stub._on_change = lambda *_: None
    stub.note_change("m", int(State.SPECULATIVE), int(State.CREATING))
    stub.note_change("m", int(State.CREATING), int(State.IDLE))
    stub.note_change("m", int(State.IDLE), int(State.CREATING))  # (illegal, but a second Create in one life)
    assert stub.lifetime_creates["m"] == 2
    stub.note_change("m", int(State.DELETING), int(State.SPECULATIVE))
    stub.note_change("m", int(State.SPECULATIVE), int(State.CREATING))
    assert stub.lifetime_creates["m"] == 1 and stub.creates_started["m"] == 3


def test_gang_member_loss_replaces_in_place_and_does_not_flap() -> None:
    """Each lost member costs at most one reclaim (the gang moves only when its rack has no slot
    left); at the end the gang is whole on one rack."""
    sim, res = _run("gang-member-loss")
    assert res.violations == [], "\n".join(map(str, res.violations))  # type: ignore[attr-defined]
    assert len(sim.lost) == 3
    reclaims = [a for line in res.trace for a in json.loads(line).get("actions", ())  # type: ignore[attr-defined]
                if a["kind"] == "Drain" and a.get("reason") == "reclaim"]
    assert len(reclaims) <= len(sim.lost), reclaims
    bound = [m for m in sim.provider.core.machines.values() if m.state == State.CONFIGURED and m.cluster == "ml"]
    assert len(bound) == 3 and len({m.labels[RACK_LABEL] for m in bound}) == 1
