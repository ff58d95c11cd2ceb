"""Shard-side fencing/dedup (InstructionGate) and the pure inventory rebalancer."""

from __future__ import annotations

from bigfleet.coordclient.client import ACCEPTED, FAILED, REJECTED_STALE, InstructionGate
from bigfleet.coordinator.rebalance import ShardView, ShortfallView, cooling_shards, plan_inventory
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
