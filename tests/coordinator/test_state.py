"""The replicated state machine, driven command by command (no Raft, no clock)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from bigfleet.coordinator.state import (
    ACCEPTED,
    ADOPTING,
    DONE,
    FAILED,
    MAX_ADOPT_ATTEMPTS,
    REJECTED_STALE,
    RELEASING,
    FleetState,
)


def hb(st: FleetState, sid: str, now: int = 1, addr: str = "") -> dict[str, Any]:
    return st.apply({"op": "heartbeat", "shard_id": sid, "now": now, "address": addr or f"{sid}:7780"})


def ack(st: FleetState, sid: str, iid: str, outcome: int = ACCEPTED, mids: list[str] | None = None, now: int = 10) -> dict[str, Any]:
    return st.apply({"op": "ack", "shard_id": sid, "now": now, "acks": [{"id": iid, "outcome": outcome, "reason": "r", "machine_ids": mids or []}]})


def check_loads(st: FleetState) -> None:
    assert st.load == dict(Counter(b.shard_id for b in st.bindings.values()))


def test_registration_is_idempotent_and_liveness_follows_heartbeats() -> None:
    st = FleetState()
    assert hb(st, "s1", 100)["registered"] is True
    assert hb(st, "s1", 200)["registered"] is False
    hb(st, "s2", 100)
    assert st.live_shards(now_ns=250, down_after_ns=100) == ["s1"]
    assert st.live_shards(now_ns=150, down_after_ns=100) == ["s1", "s2"]
    assert st.apply({"op": "heartbeat", "shard_id": "", "now": 1})["code"] == "invalid"
    assert st.apply({"op": "bogus"})["code"] == "invalid"
    assert st.apply({"op": "heartbeat"})["code"] == "invalid"  # missing fields never raise


def test_bind_first_contact_wins() -> None:
    st = FleetState()
    hb(st, "s1")
    hb(st, "s2")
    assert st.apply({"op": "bind_cluster", "cluster_id": "c", "shard_id": "s1", "now": 5})["newly_bound"] is True
    r = st.apply({"op": "bind_cluster", "cluster_id": "c", "shard_id": "s2", "now": 6})
    assert r["shard_id"] == "s1" and r["newly_bound"] is False
    assert st.apply({"op": "bind_cluster", "cluster_id": "d", "shard_id": "nope", "now": 6})["code"] == "not_found"
    check_loads(st)


def test_domains_codes_and_instructions() -> None:
    st = FleetState()
    hb(st, "s1")
    hb(st, "s2")
    assert st.apply({"op": "assign_domain", "key": "rack", "value": "r1", "shard_id": "s1"})["code"] == "ok"
    assert st.apply({"op": "assign_domain", "key": "rack", "value": "r1", "shard_id": "s1"})["changed"] is False
    assert st.apply({"op": "assign_domain", "key": "rack", "value": "r1", "shard_id": "s2"})["code"] == "already_exists"
    assert st.apply({"op": "assign_domain", "key": "rack", "value": "r2", "shard_id": "zz"})["code"] == "not_found"
    assert st.apply({"op": "assign_domain", "key": "", "value": "r2", "shard_id": "s1"})["code"] == "invalid"
    [ins] = st.pending("s1")
    assert ins.payload == {"kind": "assign_domain", "topology_key": "rack", "topology_value": "r1"}
    assert st.apply({"op": "unassign_domain", "key": "rack", "value": "r1"})["changed"] is True
    assert st.apply({"op": "unassign_domain", "key": "rack", "value": "r1"})["changed"] is False
    kinds = [i.payload["kind"] for i in st.pending("s1")]
    assert kinds == ["assign_domain", "unassign_domain"]
    seqs = [i.sequence for i in st.pending("s1")]
    assert seqs == sorted(seqs) and len(set(i.instruction_id for i in st.pending("s1"))) == 2


def test_remove_shard_cascades_and_unknown_is_not_found() -> None:
    st = FleetState()
    hb(st, "s1")
    hb(st, "s2")
    st.apply({"op": "bind_cluster", "cluster_id": "c1", "shard_id": "s1", "now": 1})
    st.apply({"op": "bind_cluster", "cluster_id": "c2", "shard_id": "s2", "now": 1})
    st.apply({"op": "assign_domain", "key": "k", "value": "v", "shard_id": "s1"})
    r = st.apply({"op": "remove_shard", "shard_id": "s1"})
    assert r["unbound_clusters"] == ["c1"]
    assert set(st.bindings) == {"c2"} and st.domains == {} and "s1" not in st.queues
    assert st.apply({"op": "remove_shard", "shard_id": "s1"})["code"] == "not_found"
    check_loads(st)


def _handoff(st: FleetState) -> str:
    hb(st, "a")
    hb(st, "b")
    st.apply({"op": "bind_cluster", "cluster_id": "c", "shard_id": "a", "now": 1})
    r = st.apply({"op": "start_handoffs", "now": 2, "moves": [{"cluster_id": "c", "from": "a", "to": "b", "transfer_id": "t1"}]})
    assert r["started"] == [{"cluster_id": "c", "from": "a", "to": "b"}]
    return "t1"


def test_cluster_handoff_release_then_adopt() -> None:
    st = FleetState()
    tid = _handoff(st)
    t = st.transfers[tid]
    assert t.phase == RELEASING and st.bindings["c"].shard_id == "a"
    # Retrying the same apply (lost callback) starts nothing new.
    again = st.apply({"op": "start_handoffs", "now": 3, "moves": [{"cluster_id": "c", "from": "a", "to": "b", "transfer_id": "t9"}]})
    assert again["skipped"] and len(st.pending("a")) == 1
    [rel] = st.pending("a")
    assert rel.payload["kind"] == "release_cluster" and rel.payload["to_shard_address"] == "b:7780"
    assert st.pending("b") == []  # the new shard hears nothing before the old one released
    ack(st, "a", rel.instruction_id, ACCEPTED, ["m2", "m1"])
    assert t.phase == ADOPTING and st.bindings["c"].shard_id == "b" and st.bindings["c"].epoch == 2
    [adopt] = st.pending("b")
    assert adopt.payload["kind"] == "adopt_cluster" and adopt.payload["machine_ids"] == ["m1", "m2"]
    ack(st, "b", adopt.instruction_id)
    assert t.phase == DONE and st.pending("a") == [] and st.pending("b") == []
    check_loads(st)
    # A duplicate ack changes nothing.
    assert ack(st, "b", adopt.instruction_id)["cleared"] == []


def test_a_cluster_bound_again_after_its_shard_is_removed_continues_its_epoch() -> None:
    """The old shard of a finished move serves the cluster again only for a newer binding epoch
    than the one it released at: rebinding after the recipient's removal must not restart at 1."""
    st = FleetState()
    tid = _handoff(st)
    [rel] = st.pending("a")
    assert rel.payload["binding_epoch"] == 2
    ack(st, "a", rel.instruction_id, ACCEPTED, ["m1"])
    [adopt] = st.pending("b")
    ack(st, "b", adopt.instruction_id)
    assert st.transfers[tid].phase == DONE and st.bindings["c"].epoch == 2
    st.apply({"op": "remove_shard", "shard_id": "b", "now": 20})
    assert "c" not in st.bindings and st.retired_epochs == {"c": 2}
    again = FleetState.from_json(json.loads(json.dumps(st.to_json())))  # survives a snapshot
    for state in (st, again):
        r = state.apply({"op": "bind_cluster", "cluster_id": "c", "shard_id": "a", "now": 21})
        assert r["newly_bound"] is True and r["epoch"] == 3 and state.bindings["c"].epoch == 3
        assert state.retired_epochs == {}
        check_loads(state)


def test_release_refused_aborts_and_keeps_binding() -> None:
    st = FleetState()
    tid = _handoff(st)
    [rel] = st.pending("a")
    ack(st, "a", rel.instruction_id, FAILED)
    assert st.transfers[tid].phase == "aborted" and st.bindings["c"].shard_id == "a"


def test_stale_rejection_keeps_the_instruction_for_redelivery() -> None:
    st = FleetState()
    _handoff(st)
    [rel] = st.pending("a")
    ack(st, "a", rel.instruction_id, REJECTED_STALE)
    assert st.pending("a") == [rel]


def test_adopt_failures_fall_back_to_the_releasing_shard() -> None:
    st = FleetState()
    tid = _handoff(st)
    [rel] = st.pending("a")
    ack(st, "a", rel.instruction_id, ACCEPTED, ["m1"])
    for _ in range(MAX_ADOPT_ATTEMPTS):
        [ad] = st.pending("b")
        ack(st, "b", ad.instruction_id, FAILED)
    t = st.transfers[tid]
    assert t.adopter == "a" and st.bindings["c"].shard_id == "a"
    [back] = st.pending("a")
    assert back.payload["kind"] == "adopt_cluster" and back.payload["machine_ids"] == ["m1"]
    ack(st, "a", back.instruction_id)
    assert t.phase == DONE
    check_loads(st)


def test_removing_the_adopter_mid_adopt_hands_everything_back() -> None:
    """The releasing shard already let go of the cluster and its machines: aborting would leave
    them with no shard (and the old shard refusing the cluster for good)."""
    st = FleetState()
    tid = _handoff(st)
    [rel] = st.pending("a")
    ack(st, "a", rel.instruction_id, ACCEPTED, ["m1"])
    r = st.apply({"op": "remove_shard", "shard_id": "b", "now": 20})
    t = st.transfers[tid]
    assert r["unbound_clusters"] == [] and t.phase == ADOPTING and t.adopter == "a"
    assert st.bindings["c"].shard_id == "a" and st.bindings["c"].epoch == 3
    [back] = st.pending("a")
    assert back.payload["kind"] == "adopt_cluster" and back.payload["machine_ids"] == ["m1"]
    ack(st, "a", back.instruction_id)
    assert t.phase == DONE
    check_loads(st)


def test_removing_the_releasing_shard_mid_adopt_lets_the_adoption_finish() -> None:
    st = FleetState()
    tid = _handoff(st)
    [rel] = st.pending("a")
    ack(st, "a", rel.instruction_id, ACCEPTED, ["m1"])
    [ad] = st.pending("b")
    st.apply({"op": "remove_shard", "shard_id": "a", "now": 20})
    assert st.transfers[tid].phase == ADOPTING and st.pending("b") == [ad] and st.bindings["c"].shard_id == "b"
    ack(st, "b", ad.instruction_id)
    assert st.transfers[tid].phase == DONE
    check_loads(st)


def test_removing_a_shard_before_the_release_aborts() -> None:
    st = FleetState()
    tid = _handoff(st)
    st.apply({"op": "remove_shard", "shard_id": "b", "now": 20})
    assert st.transfers[tid].phase == "aborted" and st.pending("a") == [] and st.bindings["c"].shard_id == "a"


def test_removing_the_recipient_of_an_inventory_transfer_mid_adopt_returns_the_machines() -> None:
    st = FleetState()
    hb(st, "d")
    hb(st, "r")
    st.apply({"op": "start_transfer", "transfer_id": "t", "kind": "inventory", "from": "d", "to": "r", "now": 1,
              "requirements": [], "deficit": {"cpu": "8"}})
    [rel] = st.pending("d")
    ack(st, "d", rel.instruction_id, ACCEPTED, ["i1"])
    st.apply({"op": "remove_shard", "shard_id": "r", "now": 20})
    [back] = st.pending("d")
    assert back.payload["kind"] == "transfer_ownership" and back.payload["machine_ids"] == ["i1"]
    assert back.payload["to_shard_id"] == "d"
    ack(st, "d", back.instruction_id)
    assert st.transfers["t"].phase == DONE


def test_inventory_transfer_two_phases_and_one_per_shard() -> None:
    st = FleetState()
    hb(st, "d")
    hb(st, "r")
    hb(st, "x")
    cmd = {"op": "start_transfer", "transfer_id": "t", "kind": "inventory", "from": "d", "to": "r", "now": 1,
           "requirements": [{"key": "zone", "operator": "OPERATOR_IN", "values": ["z1"]}], "deficit": {"cpu": "8"}}
    assert st.apply(cmd)["started"] is True
    assert st.apply(cmd)["started"] is False
    assert st.apply({**cmd, "transfer_id": "t2", "from": "x"})["code"] == "conflict"
    [rel] = st.pending("d")
    assert rel.payload["kind"] == "transfer_ownership" and rel.payload["machine_ids"] == []
    ack(st, "d", rel.instruction_id, ACCEPTED, ["i1"])
    [ad] = st.pending("r")
    assert ad.payload["machine_ids"] == ["i1"] and ad.payload["to_shard_id"] == "r"
    ack(st, "r", ad.instruction_id)
    assert st.transfers["t"].phase == DONE
    # A donor that had nothing to give ends the transfer without an adopt.
    st.apply({**cmd, "transfer_id": "t3", "kind": "drain", "preemptor_priority": 9})
    [rel3] = st.pending("d")
    assert rel3.payload["kind"] == "cross_shard_drain" and rel3.payload["preemptor_priority"] == 9
    ack(st, "d", rel3.instruction_id, ACCEPTED, [])
    assert st.transfers["t3"].phase == DONE and st.pending("r") == []


def test_snapshot_roundtrip_is_identical_and_restore_is_idempotent() -> None:
    st = FleetState()
    _handoff(st)
    st.apply({"op": "assign_domain", "key": "k", "value": "v", "shard_id": "b"})
    st.apply({"op": "register_member", "node_id": "n1", "raft_address": "r:1", "grpc_address": "g:1"})
    data = json.loads(json.dumps(st.to_json()))
    back = FleetState.from_json(data)
    assert back.to_json() == st.to_json()
    assert back.load == st.load
    # Restore into a fresh state through the command; a retried restore is a no-op.
    fresh = FleetState()
    fresh.apply({"op": "restore", "state": data, "term_offset": 7, "incarnation": "abc"})
    assert fresh.term_offset == 7 and fresh.incarnation == "abc"
    expect = {**data, "term_offset": 7, "incarnation": "abc"}
    assert fresh.to_json() == expect
    hb(fresh, "newshard")
    assert fresh.apply({"op": "restore", "state": data, "term_offset": 7, "incarnation": "abc"}).get("already") is True
    assert "newshard" in fresh.shards
    # Instruction ids minted after a restore differ from the ones before it.
    before_ids = {i.instruction_id for q in st.queues.values() for i in q.values()}
    fresh.apply({"op": "assign_domain", "key": "k2", "value": "v", "shard_id": "b"})
    after_ids = {i.instruction_id for q in fresh.queues.values() for i in q.values()}
    assert len(after_ids - before_ids) == 1


def test_upstream_go_snapshot_payload_is_accepted() -> None:
    go = {
        "shards": [{"ID": "s1", "Address": "10.0.0.1:7780", "RegisteredAt": "2026-01-01T00:00:00Z", "LastHeartbeat": "2026-01-01T00:00:00Z"}],
        "cluster_to_shard": {"c1": "s1"},
        "domain_to_shard": [{"domain": {"Key": "rack", "Value": "r1"}, "shard": "s1"}],
        "quotas": [],
    }
    st = FleetState.from_json(go)
    assert st.shards["s1"].address == "10.0.0.1:7780"
    assert st.bindings["c1"].shard_id == "s1" and st.load == {"s1": 1}
    assert st.domains["rack=r1"] == ("rack", "r1", "s1")


def test_abort_before_release_and_late_release_goes_back_to_the_releaser() -> None:
    st = FleetState()
    tid = _handoff(st)
    [rel] = st.pending("a")
    assert st.apply({"op": "abort_transfer", "transfer_id": tid, "now": 5})["code"] == "ok"
    assert st.transfers[tid].phase == "aborted" and st.pending("a") == []
    assert st.apply({"op": "abort_transfer", "transfer_id": "nope"})["code"] == "not_found"
    # The shard had already released before the abort reached it: the machines come back to it.
    ack(st, "a", rel.instruction_id, ACCEPTED, ["m1"])
    [back] = st.pending("a")
    assert back.payload["kind"] == "adopt_cluster" and back.payload["machine_ids"] == ["m1"]
    assert st.pending("b") == [] and st.bindings["c"].shard_id == "a"
    ack(st, "a", back.instruction_id)
    assert st.transfers[tid].phase == DONE


def test_abort_refused_once_machines_were_released() -> None:
    st = FleetState()
    tid = _handoff(st)
    [rel] = st.pending("a")
    ack(st, "a", rel.instruction_id, ACCEPTED, ["m1"])
    assert st.apply({"op": "abort_transfer", "transfer_id": tid, "now": 5})["code"] == "conflict"


def test_an_empty_inventory_release_records_the_donors_free_count() -> None:
    """The rebalancer's memory of a fruitless donor lives in the replicated transfer (survives failover and restore)."""
    st = FleetState()
    hb(st, "d")
    hb(st, "r")
    cmd = {"op": "start_transfer", "transfer_id": "t", "kind": "inventory", "from": "d", "to": "r", "now": 1,
           "requirements": [], "deficit": {"cpu": "8"}, "preemptor_priority": 7, "donor_free": 5}
    st.apply(cmd)
    assert st.transfers["t"].donor_free == 5  # the count the plan acted on
    [rel] = st.pending("d")
    empty_ack = {"op": "ack", "shard_id": "d", "now": 10, "free_machines": 4,
                 "acks": [{"id": rel.instruction_id, "outcome": ACCEPTED, "reason": "", "machine_ids": []}]}
    st.apply(empty_ack)
    t = st.transfers["t"]
    assert (t.phase, t.machine_ids, t.donor_free, t.preemptor_priority) == (DONE, [], 4, 7)  # the count beside the answer
    # Idempotent: the same ack again (a lost callback's retry) changes nothing, even with another count.
    st.apply({**empty_ack, "free_machines": 9})
    assert t.donor_free == 4
    # A refused release is recorded the same way; a release that moved machines is not touched.
    st.apply({**cmd, "transfer_id": "t2", "donor_free": 6})
    [rel2] = st.pending("d")
    st.apply({**empty_ack, "free_machines": 2, "acks": [{"id": rel2.instruction_id, "outcome": FAILED, "reason": "x", "machine_ids": []}]})
    assert (st.transfers["t2"].phase, st.transfers["t2"].donor_free) == ("aborted", 2)
    st.apply({**cmd, "transfer_id": "t3", "donor_free": 6})
    [rel3] = st.pending("d")
    st.apply({**empty_ack, "free_machines": 1, "acks": [{"id": rel3.instruction_id, "outcome": ACCEPTED, "reason": "", "machine_ids": ["m"]}]})
    assert (st.transfers["t3"].phase, st.transfers["t3"].donor_free) == (ADOPTING, 6)
    # Snapshot round trip keeps it; a snapshot written before the field existed reads -1 (unknown).
    data = json.loads(json.dumps(st.to_json()))
    assert FleetState.from_json(data).to_json() == st.to_json()
    for row in data["transfers"]:
        del row["donor_free"]
    assert FleetState.from_json(data).transfers["t"].donor_free == -1
