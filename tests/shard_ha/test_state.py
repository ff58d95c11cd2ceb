"""The replicated state machine (pure) and the new leader's store restore."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path

from bigfleet.decision.types import EngineState
from bigfleet.shard.ha.controller import read_epoch, store_epoch
from bigfleet.shard.ha.node import LocalLog
from bigfleet.shard.ha.state import Actuation, HAState
from bigfleet.shard.store import ReplicatedStore
from bigfleet.v1alpha1 import capacity_pb2

from .group import need


def _rollup(cluster: str, *cpus: str) -> bytes:
    return capacity_pb2.ClusterCapacityNeeds(cluster_id=cluster, needs=[need(c, priority=100 + i) for i, c in enumerate(cpus)]).SerializeToString()


def test_claim_bumps_epoch_once_per_term_and_is_idempotent() -> None:
    s = HAState()
    assert s.claim(3, "a", "A") == 1
    assert s.claim(3, "a", "A") == 1  # retried write: same epoch
    assert s.claim(3, "b", "B") == 0  # a second node in the same term is refused
    assert s.claim(2, "b", "B") == 0  # an older term is refused
    assert s.claim(5, "b", "B") == 2
    assert (s.leader_node, s.leader_advertise) == ("b", "B")


def test_replace_only_from_the_current_epoch() -> None:
    s = HAState()
    e = s.claim(1, "a", "A")
    assert s.replace("c1", _rollup("c1", "1"), 10, e)
    assert s.claim(2, "b", "B") == 2
    assert not s.replace("c1", _rollup("c1", "1", "2"), 11, e)  # deposed leader's late write
    assert s.rollups["c1"].received_unix_nanos == 10
    assert s.replace("c1", _rollup("c1", "1", "2"), 12, 2)
    assert s.rollups["c1"].seq == 2 and s.first_rollup == {"c1"}
    assert not s.replace("", b"", 1, 2)


def test_engine_state_versions_and_carried_first_rollup_flags() -> None:
    s = HAState()
    e = s.claim(1, "a", "A")
    s.replace("c1", _rollup("c1", "1"), 1, e)
    st1 = EngineState(cycle=5, shortfall_ages={"k": 2})
    assert s.save_engine(st1, 1, e)
    assert not s.save_engine(EngineState(cycle=4), 1, e)  # reordered retry of an older version
    assert not s.save_engine(EngineState(cycle=9), 2, e + 1)  # not the current epoch
    carried = s.carried()
    assert carried.cycle == 5 and carried.shortfall_ages == {"k": 2}
    assert "c1" in carried.first_rollup
    e2 = s.claim(2, "b", "B")  # a new leader's versions start over
    assert s.save_engine(EngineState(cycle=6), 1, e2)


def test_state_survives_a_snapshot_round_trip() -> None:
    # pysyncobj snapshots pickle the consumer's attributes; so does its transport.
    s = HAState()
    e = s.claim(1, "a", "A")
    s.replace("c1", _rollup("c1", "1"), 1, e)
    s.save_engine(EngineState(cycle=3, parking={"g": 1}), 1, e)
    t = pickle.loads(pickle.dumps(s))
    assert t == s


async def test_restore_builds_the_leaders_table_and_gate() -> None:
    s = HAState()
    e = s.claim(1, "a", "A")
    s.replace("c1", _rollup("c1", "1", "2"), 100, e)
    s.replace("c2", _rollup("c2", "4"), 200, e)
    s.save_engine(EngineState(cycle=7, unmet_ages={"c1/x": 3}), 1, e)
    store = ReplicatedStore(LocalLog(s), e)
    assert store.restore(s) == 2
    assert len(store.table.cluster("c1")) == 2 and len(store.table.cluster("c2")) == 1
    assert store.has_rolled_up("c1") and store.has_rolled_up("c2")
    assert store.engine_state().cycle == 7 and store.engine_state().unmet_ages == {"c1/x": 3}
    await asyncio.sleep(0)


def test_claim_respects_the_claimants_epoch_floor() -> None:
    s = HAState()
    assert s.claim(1, "a", "A", floor=7) == 8  # data dir came from single-replica mode at epoch 7
    assert s.claim(2, "b", "B", floor=3) == 9  # a lower floor never lowers the epoch


def test_epoch_file_only_moves_forward(tmp_path: Path) -> None:
    p = tmp_path / "epoch"
    assert read_epoch(p) == 0
    store_epoch(p, 5)
    store_epoch(p, 3)
    assert read_epoch(p) == 5
    p.write_text("garbage")
    assert read_epoch(p) == 0


def test_ledger_and_actuation_are_replicated_epoch_guarded_and_survive_a_snapshot() -> None:
    s = HAState()
    e = s.claim(1, "a", "A")
    s.replace("c1", _rollup("c1", "1"), 1, e)
    assert s.release_cluster("c1", ("m2", "m1"), "B", "b:1", e) == ("m1", "m2")
    assert "c1" not in s.rollups and "c1" not in s.first_rollup  # its demand left with it
    assert s.release_machines(("m5",), "transfer:t1", e) == ("m5",)
    assert s.adopt(("m9",), "", e)
    assert s.set_actuation(True, False, e)
    e2 = s.claim(2, "b", "B")  # a new leader: the old epoch can no longer write
    assert s.set_actuation(False, False, e) is False and s.actuation is not None and s.actuation.paused
    assert s.release_machines(("m6",), "transfer:t2", e) is None and "m6" not in s.ledger.released
    assert not s.adopt(("m7",), "", e)
    t = pickle.loads(pickle.dumps(s))  # what a snapshot install hands a follower
    assert t == s and t.ledger.released == {"m1": "c1", "m2": "c1", "m5": "transfer:t1"}
    assert t.actuation is not None and t.actuation.paused and t.epoch == e2
    copy = s.copy()
    copy.ledger.released.clear()
    assert s.ledger.released  # a leader's copy never aliases the live ledger


def test_changed_flags_set_the_switch_unchanged_flags_keep_a_runtime_one() -> None:
    s = HAState()
    e = s.claim(1, "a", "A")
    assert s.apply_actuation_flags(True, False, e)  # started with --paused
    assert s.actuation is not None and s.actuation.paused
    assert s.set_actuation(False, False, e)  # bigfleetctl resume
    e2 = s.claim(2, "b", "B")
    assert s.apply_actuation_flags(True, False, e2)  # a failover, same flags: the resume stays
    assert s.actuation is not None and not s.actuation.paused
    e3 = s.claim(3, "a", "A")
    assert s.apply_actuation_flags(False, True, e3)  # a rollout with new flags: they win
    assert s.actuation == Actuation(False, True)
    assert not s.apply_actuation_flags(True, True, e)  # a deposed leader's epoch


def test_replicated_command_numbers_are_stable() -> None:
    """pysyncobj numbers replicated methods in sorted-name order and journals hold the numbers: the
    commands of earlier releases keep their numbers, new ones come after them."""
    from bigfleet.shard.ha.node import _Replicated

    r = _Replicated()
    names = sorted(m for m in dir(r) if getattr(getattr(r, m), "replicated", False)
                   and m != getattr(r, m).origName)
    released = ["adopt", "apply_actuation_flags", "claim", "hold_rollup", "record_disruptions", "release_cluster",
                "release_machines", "replace", "save_engine", "set_actuation", "track_retiring",
                "upsert_rollups"]
    assert names[:len(released)] == [f"{n}_v0" for n in released], names


def test_retiring_is_tracked_and_guarded_by_epoch() -> None:
    from bigfleet.shard.ha.state import Retiring

    s = HAState(epoch=3)
    entry = Retiring("c1", "node-1", "RegistrationTimeout: node node-1 did not register within 900s", 5)
    assert not s.track_retiring("m1", entry, epoch=2)
    assert s.track_retiring("m1", entry, epoch=3) and s.copy().retiring == {"m1": entry}
    assert s.track_retiring("m1", None, epoch=3) and s.retiring == {}


def test_a_snapshot_from_an_earlier_release_restores_with_defaults() -> None:
    s = HAState(epoch=4)
    s.track_retiring("m1", None, epoch=4)
    del s.__dict__["retiring"]  # (as pickled by a release without the field)
    back = pickle.loads(pickle.dumps(s))
    assert back.epoch == 4 and back.retiring == {}


async def test_carried_state_writes_coalesce_while_cycles_run_back_to_back() -> None:
    """The first state goes at once; states saved within the write gap collapse into the newest."""
    s = HAState()
    e = s.claim(1, "a", "A")
    store = ReplicatedStore(LocalLog(s), e, write_gap=0.5)
    try:
        for c in range(1, 6):
            store.save_engine_state(EngineState(cycle=c))
            await asyncio.sleep(0.01)
        assert store.engine_writes == 1 and s.carried().cycle == 1
        for _ in range(300):
            if store.engine_writes >= 2:
                break
            await asyncio.sleep(0.01)
        assert store.engine_writes == 2 and s.carried().cycle == 5  # cycles 2-4 were never written
    finally:
        await store.close()
