"""Gangs under member churn, every strict spread term, and preemption while a victim drains."""

from __future__ import annotations

import pytest

from bigfleet.decision import Drain, EngineState
from bigfleet.machine import CapacityType
from bigfleet.needs import Need, TopologySpread

from .fx import ZONE_KEY, S, configures, creates, drains, machine, need, profile, run, same_zone

OD = CapacityType.ON_DEMAND
RACK_KEY = "rack"


def _gang() -> Need:
    return need("c", 3, same_zone(group="train"))


def _member(mid: str, gang: Need, state: S = S.CONFIGURED) -> object:
    cluster = "c" if state is S.CONFIGURED else ""
    return machine(mid, state, zone="a", cluster=cluster, fp=gang.fingerprint, group="train", prio=gang.priority)


@pytest.mark.parametrize("sticky", [True, False], ids=["sticky-domain", "ranked-afresh"])
def test_gang_with_a_creating_replacement_stays_in_its_domain(sticky: bool) -> None:
    """Zone a holds two Configured members and a Creating replacement for the lost third; zone b has
    three free machines. The gang stays in a: nothing is configured in b and nothing reclaimed."""
    gang = _gang()
    first = run([gang], [machine(f"a{i}", zone="a") for i in range(3)] + [machine(f"b{i}", zone="b") for i in range(3)])
    assert first.verdicts[0].same_domain == "a"
    state = first.state if sticky else EngineState()
    ms = [_member("a0", gang), _member("a1", gang), _member("a2", gang, S.CREATING)]
    ms += [machine(f"b{i}", zone="b") for i in range(3)]
    d = run([gang], ms, state=state, ready=["c"])
    assert configures(d) == [] and drains(d) == [], d.actions
    assert d.verdicts[0].same_domain == "a" and d.verdicts[0].satisfied


def _racked(zone_rack: list[tuple[str, str]], prefix: str = "m") -> list[object]:
    return [machine(f"{prefix}{i}-{z}-{r}", S.SPECULATIVE, zone=z, labels={RACK_KEY: r}, ctype=OD, price=1.0)
            for i, (z, r) in enumerate(zone_rack)]


@pytest.mark.parametrize(
    ("supply", "units", "want_zones", "want_racks"),
    [
        # zone a is cheap but on one rack: both terms together force a 2/2 split over zones and racks
        ([("a", "r1")] * 4 + [("b", "r2")] * 4, 4, {"a": 2, "b": 2}, {"r1": 2, "r2": 2}),
        # zones balance on their own, racks only by the second term
        ([("a", "r1")] * 2 + [("a", "r2")] * 2 + [("b", "r1")] * 2 + [("b", "r2")] * 2, 4,
         {"a": 2, "b": 2}, {"r1": 2, "r2": 2}),
        # id order would fill r1 and r3 twice; the rack term spreads each zone's pair over its racks
        ([("a", "r1"), ("a", "r1"), ("a", "r2"), ("b", "r3"), ("b", "r3"), ("b", "r4")], 4,
         {"a": 2, "b": 2}, {"r1": 1, "r2": 1, "r3": 1, "r4": 1}),
    ],
)
def test_every_strict_spread_term_is_honoured(supply: list[tuple[str, str]], units: int,
                                              want_zones: dict[str, int], want_racks: dict[str, int]) -> None:
    terms = [TopologySpread(ZONE_KEY, 1), TopologySpread(RACK_KEY, 1)]
    ms = _racked(supply)
    by_id = {m.id: m for m in ms}  # type: ignore[attr-defined]
    d = run([need("c", units, profile(spread=terms))], ms)
    zones: dict[str, int] = {}
    racks: dict[str, int] = {}
    for a in creates(d):
        m = by_id[a.machine_id]
        zones[m.zone] = zones.get(m.zone, 0) + 1
        racks[m.labels[RACK_KEY]] = racks.get(m.labels[RACK_KEY], 0) + 1
    assert zones == want_zones and racks == want_racks


def test_a_victim_already_draining_is_not_doubled_next_cycle() -> None:
    """Cycle 1 preempts one low-priority machine for a one-unit need; while it drains (cycle 2) the
    need is still short, but the draining machine is on its way: no second victim."""
    hi = need("hi", 1, profile(1_000_000))
    victims = [machine(f"v{i}", S.CONFIGURED, cluster="lo", prio=0) for i in range(2)]
    lo = need("lo", 2, profile(0))
    d1 = run([hi, lo], victims)
    first = [a for a in drains(d1) if a.reason == "preempt"]
    assert [a.machine_id for a in first] == ["v0"]
    draining = [machine("v0", S.DRAINING, cluster="lo", prio=0), victims[1]]
    d2 = run([hi, lo], draining, state=d1.state)
    assert [a for a in d2.actions if isinstance(a, Drain)] == [], d2.actions
    assert not d2.verdicts[0].satisfied  # still short until the drained machine is acquired
