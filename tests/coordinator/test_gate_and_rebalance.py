"""Shard-side fencing/dedup (InstructionGate) and the pure inventory rebalancer."""

from __future__ import annotations

from typing import Any

import pytest

from bigfleet.coordclient.client import ACCEPTED, FAILED, REJECTED_STALE, InstructionGate
from bigfleet.coordinator.rebalance import (
    FRUITLESS_TTL,
    FruitlessTransfer,
    ShardView,
    ShortfallView,
    cooling_shards,
    plan_inventory,
)
from bigfleet.v1alpha1 import coordinator_pb2 as pb


def ins(iid: str, term: int, seq: int) -> pb.CoordinatorInstruction:
    return pb.CoordinatorInstruction(instruction_id=iid, coordinator_term=term, sequence_number=seq, assign_domain=pb.AssignDomain(topology_key="k", topology_value=iid))


def test_gate_fences_by_term_and_dedups_by_id() -> None:
    g = InstructionGate()
    run = g.admit(pb.ReportAck(coordinator_term=5, instructions=[ins("b", 5, 2), ins("a", 5, 1)]))
    assert [i.instruction_id for i in run] == ["a", "b"]  # sequence order
    # Redelivered while running: skipped, no ack yet.
    assert g.admit(pb.ReportAck(coordinator_term=5, instructions=[ins("a", 5, 1)])) == []
    assert g.take_acks() == []
    g.finish("a", ACCEPTED, machine_ids=["m1"])
    g.finish("b", FAILED, "boom")
    acks = g.take_acks()
    assert [(a.instruction_id, a.outcome) for a in acks] == [("a", ACCEPTED), ("b", FAILED)]
    assert list(acks[0].machine_ids) == ["m1"]
    # The report carrying them failed: they stay queued; after success they are gone.
    assert len(g.take_acks()) == 2
    g.delivered(acks)
    assert g.take_acks() == []
    # Redelivery after completion re-acks the first outcome without running again.
    assert g.admit(pb.ReportAck(coordinator_term=5, instructions=[ins("a", 5, 1)])) == []
    [dup] = g.take_acks()
    assert dup.outcome == ACCEPTED and list(dup.machine_ids) == ["m1"] and dup.reason == "duplicate-redelivery"
    g.delivered([dup])
    # A stale response is dropped whole; a stale instruction inside a fresh one is rejected.
    assert g.admit(pb.ReportAck(coordinator_term=7, instructions=[])) == []
    assert g.high_water == 7
    assert g.admit(pb.ReportAck(coordinator_term=6, instructions=[ins("c", 6, 3)])) == []
    assert g.take_acks() == []
    assert g.admit(pb.ReportAck(coordinator_term=7, instructions=[ins("d", 6, 4), ins("e", 7, 5)]))[0].instruction_id == "e"
    [stale] = g.take_acks()
    assert stale.instruction_id == "d" and stale.outcome == REJECTED_STALE


def test_gate_state_survives_a_restart() -> None:
    g = InstructionGate()
    g.admit(pb.ReportAck(coordinator_term=3, instructions=[ins("a", 3, 1)]))
    g.finish("a", ACCEPTED, machine_ids=["m"])
    h = InstructionGate()
    h.load_json(g.to_json())
    assert h.high_water == 3
    assert h.admit(pb.ReportAck(coordinator_term=3, instructions=[ins("a", 3, 1)])) == []
    assert list(h.take_acks()[0].machine_ids) == ["m"]


def sv(sid: str, free: int, total: int, *sf: tuple[int, int]) -> ShardView:
    return ShardView(sid, free, total, [ShortfallView(p, age, [], {"cpu": "4"}) for p, age in sf])


def test_rebalancer_is_demand_pull_and_prefers_idle_donors() -> None:
    assert plan_inventory([sv("a", 10, 10), sv("b", 0, 5, (100, 3))]) == []  # not aged yet
    [it] = plan_inventory([sv("a", 10, 10), sv("b", 0, 5, (100, 6)), sv("c", 2, 10)])
    assert (it.kind, it.donor, it.recipient, it.priority, it.deficit) == ("inventory", "a", "b", 100, {"cpu": "4"})
    # A donor with its own need of equal or higher priority is never robbed.
    assert plan_inventory([sv("a", 10, 10, (100, 1)), sv("b", 0, 5, (100, 6))]) == []
    # No free machines anywhere: drain only once the shortfall is old enough.
    assert plan_inventory([sv("a", 0, 10), sv("b", 0, 5, (100, 8))]) == []
    [d] = plan_inventory([sv("a", 0, 10), sv("b", 0, 5, (100, 13))])
    assert (d.kind, d.donor) == ("drain", "a")
    # Busy and cooling shards are skipped; one transfer per shard per tick.
    assert plan_inventory([sv("a", 10, 10), sv("b", 0, 5, (100, 6))], busy=["a"]) == []
    assert plan_inventory([sv("a", 10, 10), sv("b", 0, 5, (100, 6))], cooling=["b"]) == []
    two = plan_inventory([sv("a", 10, 10), sv("b", 0, 5, (100, 6)), sv("c", 0, 5, (200, 6))])
    assert [(i.donor, i.recipient) for i in two] == [("a", "c")]
    assert cooling_shards({"a": 100.0, "b": 10.0}, now=105.0, cooldown=60.0) == {"a"}


# ---- escalation past donors that came back empty (the 2-shard bug: a priority-2 000 000
# shortfall never got capacity while a priority-1 000 cluster on the other shard held the pool,
# because that shard's free machines of other shapes kept it the tier-1 donor forever).

HI = 2_000_000
SEL = [{"key": "node.kubernetes.io/instance-type", "operator": "OPERATOR_IN", "values": ["gpu-8"]}]
NOW = 10_000.0


def need(sid: str, free: int, total: int, age: int, prio: int = HI, sel: list[dict[str, Any]] | None = None) -> ShardView:
    return ShardView(sid, free, total, [ShortfallView(prio, age, SEL if sel is None else sel, {"gpu": "8"})])


def empty(kind: str, donor: str, ago: float = 30.0, donor_free: int = 3, prio: int = HI,
          sel: list[dict[str, Any]] | None = None, recipient: str = "hi") -> FruitlessTransfer:
    return FruitlessTransfer(kind, donor, recipient, prio, SEL if sel is None else sel, NOW - ago, donor_free)


# (case, shards, fruitless transfers, expected [(kind, donor)])
ESCALATION: list[tuple[str, list[ShardView], list[FruitlessTransfer], list[tuple[str, str]]]] = [
    ("matching supply present: tier 1 even past the drain age",
     [need("hi", 0, 4, 20), ShardView("lo", 3, 40)], [], [("inventory", "lo")]),
    ("empty tier-1 release, old shortfall: tier 2 against the same donor",
     [need("hi", 0, 4, 20), ShardView("lo", 3, 40)], [empty("inventory", "lo")], [("drain", "lo")]),
    ("empty tier-1 release, shortfall not yet at the drain age: wait",
     [need("hi", 0, 4, 8), ShardView("lo", 3, 40)], [empty("inventory", "lo")], []),
    ("empty tier-1 release from one donor: tier 1 from the next one first",
     [need("hi", 0, 4, 20), ShardView("lo", 9, 40), ShardView("other", 2, 10)],
     [empty("inventory", "lo", donor_free=9)], [("inventory", "other")]),
    ("every donor with free machines came back empty: tier 2 against the largest",
     [need("hi", 0, 4, 20), ShardView("lo", 9, 40), ShardView("other", 2, 10)],
     [empty("inventory", "lo", donor_free=9), empty("inventory", "other", donor_free=2)], [("drain", "lo")]),
    ("donor gained free machines since it came back empty: tier 1 again",
     [need("hi", 0, 4, 20), ShardView("lo", 4, 40)], [empty("inventory", "lo", donor_free=3)], [("inventory", "lo")]),
    ("donor lost free machines since: still skipped",
     [need("hi", 0, 4, 20), ShardView("lo", 2, 40)], [empty("inventory", "lo", donor_free=3)], [("drain", "lo")]),
    ("memory expired: tier 1 again",
     [need("hi", 0, 4, 20), ShardView("lo", 3, 40)], [empty("inventory", "lo", ago=FRUITLESS_TTL)], [("inventory", "lo")]),
    ("memory is per selector: another shape is still asked of tier 1",
     [need("hi", 0, 4, 20, sel=[{"key": "zone", "operator": "OPERATOR_IN", "values": ["z9"]}]), ShardView("lo", 3, 40)],
     [empty("inventory", "lo")], [("inventory", "lo")]),
    ("memory is per priority",
     [need("hi", 0, 4, 20, prio=HI + 1), ShardView("lo", 3, 40)], [empty("inventory", "lo")], [("inventory", "lo")]),
    ("memory is per recipient",
     [need("hi", 0, 4, 20), ShardView("lo", 3, 40)], [empty("inventory", "lo", recipient="someone-else")],
     [("inventory", "lo")]),
    ("selector key order does not matter",
     [need("hi", 0, 4, 20), ShardView("lo", 3, 40)],
     [empty("inventory", "lo", sel=[{"values": ["gpu-8"], "operator": "OPERATOR_IN", "key": "node.kubernetes.io/instance-type"}])],
     [("drain", "lo")]),
    ("an empty drain moves tier 2 on to the next shard",
     [need("hi", 0, 4, 20), ShardView("lo", 0, 40), ShardView("small", 0, 5)], [empty("drain", "lo")], [("drain", "small")]),
    ("an empty drain does not block tier 1 from that donor",
     [need("hi", 0, 4, 20), ShardView("lo", 3, 40)], [empty("drain", "lo")], [("inventory", "lo")]),
    ("a donor with an unmet need of equal priority is never drained",
     [need("hi", 0, 4, 20), need("lo", 3, 40, 1)], [empty("inventory", "lo")], []),
]


@pytest.mark.parametrize(("shards", "fruitless", "want"), [c[1:] for c in ESCALATION], ids=[c[0] for c in ESCALATION])
def test_rebalancer_escalates_past_donors_that_came_back_empty(
    shards: list[ShardView], fruitless: list[FruitlessTransfer], want: list[tuple[str, str]]
) -> None:
    got = plan_inventory(shards, fruitless=fruitless, now=NOW)
    assert [(i.kind, i.donor) for i in got] == want
    for i in got:
        assert (i.recipient, i.priority, i.requirements) == ("hi", shards[0].shortfalls[0].priority, shards[0].shortfalls[0].requirements)
        assert i.donor_free == next(s.free_machines for s in shards if s.shard_id == i.donor)


def test_rebalancer_needs_a_clock_to_age_its_memory() -> None:
    with pytest.raises(ValueError):
        plan_inventory([need("hi", 0, 4, 20), ShardView("lo", 3, 40)], fruitless=[empty("inventory", "lo")])
