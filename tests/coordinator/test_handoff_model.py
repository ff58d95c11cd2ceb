"""Property test of the fenced handoff protocol: the FSM against model shards under lost,
duplicated and failed acks. No machine is ever owned twice, none is ever lost."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from bigfleet.coordinator.state import ABORTED, ACCEPTED, ADOPTING, FAILED, RELEASING, FleetState

SHARDS = ["a", "b", "c"]
CLUSTERS = ["k1", "k2", "k3"]


@dataclass
class ModelShard:
    sid: str
    clusters: dict[str, set[str]] = field(default_factory=dict)
    done: dict[str, dict[str, Any]] = field(default_factory=dict)  # instruction id -> ack (dedup)
    outbox: dict[str, dict[str, Any]] = field(default_factory=dict)
    released: dict[str, list[str]] = field(default_factory=dict)  # handoff id -> ids (idempotent release)
    idle: set[str] = field(default_factory=set)  # machines serving no cluster (inventory transfers)

    def process(self, fsm: FleetState, fail: bool) -> None:
        for ins in fsm.pending(self.sid):
            iid = ins.instruction_id
            if iid in self.done:
                self.outbox[iid] = self.done[iid]  # re-ack the first outcome
                continue
            p = ins.payload
            ack: dict[str, Any] = {"id": iid, "outcome": ACCEPTED, "reason": "", "machine_ids": []}
            if fail:
                ack["outcome"] = FAILED
            elif p["kind"] == "release_cluster":
                hid = p["handoff_id"]
                if hid not in self.released:
                    self.released[hid] = sorted(self.clusters.pop(p["cluster_id"], set()))
                ack["machine_ids"] = self.released[hid]
            elif p["kind"] == "adopt_cluster":
                self.clusters.setdefault(p["cluster_id"], set()).update(p["machine_ids"])
            elif p["kind"] in ("transfer_ownership", "cross_shard_drain") and not p["machine_ids"]:
                tid = p["transfer_id"]  # donor side: give up to two idle machines
                if tid not in self.released:
                    give = sorted(self.idle)[:2]
                    self.idle -= set(give)
                    self.released[tid] = give
                ack["machine_ids"] = self.released[tid]
            elif p["kind"] == "transfer_ownership":
                self.idle.update(p["machine_ids"])  # recipient (or the donor taking them back)
            self.done[iid] = ack
            self.outbox[iid] = ack


def owners(shards: dict[str, ModelShard]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for s in shards.values():
        for ms in [*s.clusters.values(), s.idle]:
            for m in ms:
                out.setdefault(m, []).append(s.sid)
    return out


def in_transit(fsm: FleetState) -> set[str]:
    return {m for t in fsm.transfers.values() if t.phase == ADOPTING for m in t.machine_ids}


event = st.one_of(
    st.tuples(st.just("start"), st.sampled_from(CLUSTERS), st.sampled_from(SHARDS)),
    st.tuples(st.just("process"), st.sampled_from(SHARDS), st.booleans()),
    st.tuples(st.just("report"), st.sampled_from(SHARDS), st.sampled_from(["ok", "lost_request", "lost_response"])),
    # A whole heartbeat round: every shard processes (failing per the mask) and reports.
    st.tuples(st.just("round"), st.tuples(st.booleans(), st.booleans(), st.booleans())),
    # An admin aborts whatever transfer the cluster has in flight.
    st.tuples(st.just("abort"), st.sampled_from(CLUSTERS)),
    # The rebalancer moves idle machines (tier 1) or drains (tier 2) between shards; or an admin aborts one.
    st.tuples(st.just("xfer"), st.sampled_from(SHARDS), st.sampled_from(SHARDS), st.sampled_from(["inventory", "drain"])),
    st.tuples(st.just("abort_xfer"), st.integers(1, 20)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(event, max_size=60))
def test_handoffs_never_double_own_or_lose_a_machine(events: list[tuple[Any, ...]]) -> None:
    fsm = FleetState()
    shards = {s: ModelShard(s) for s in SHARDS}
    all_machines: set[str] = set()
    now = 1
    for s in SHARDS:
        fsm.apply({"op": "heartbeat", "shard_id": s, "now": now, "address": f"{s}:1"})
    for i, c in enumerate(CLUSTERS):
        home = SHARDS[i % len(SHARDS)]
        fsm.apply({"op": "bind_cluster", "cluster_id": c, "shard_id": home, "now": now})
        ms = {f"{c}-m{j}" for j in range(2)}
        shards[home].clusters[c] = set(ms)
        all_machines |= ms
    for s in SHARDS:
        spare = {f"{s}-idle{j}" for j in range(3)}
        shards[s].idle = set(spare)
        all_machines |= spare
    tid = 0

    def check() -> None:
        own = owners(shards)
        assert all(len(v) == 1 for v in own.values()), own
        transit = in_transit(fsm)
        # Released by the old shard, ack not yet applied by the coordinator.
        for sh in shards.values():
            for hid, ids in sh.released.items():
                if fsm.transfers[hid].phase in (RELEASING, ABORTED):
                    transit |= set(ids)
        # Every machine is held by exactly one shard, or released and awaiting adoption.
        assert set(own) | transit == all_machines
        # A machine counted in transit may already be adopted (ack not yet seen), but never owned by the releaser.
        for t in fsm.transfers.values():
            if t.phase == ADOPTING:
                for m in t.machine_ids:
                    assert own.get(m, [None])[0] != t.from_shard or t.adopter == t.from_shard

    def report(s: str, mode: str) -> None:
        sh = shards[s]
        acks = list(sh.outbox.values())
        if mode != "lost_request":
            fsm.apply({"op": "ack", "shard_id": s, "now": now, "acks": acks})
        if mode == "ok":
            for a in acks:
                sh.outbox.pop(a["id"], None)

    for ev in events:
        now += 1
        if ev[0] == "start":
            _, c, to = ev
            tid += 1
            fsm.apply({"op": "start_handoffs", "now": now, "moves": [{"cluster_id": c, "from": fsm.bindings[c].shard_id, "to": to, "transfer_id": f"t{tid}"}]})
        elif ev[0] == "process":
            shards[ev[1]].process(fsm, ev[2])
        elif ev[0] == "xfer":
            tid += 1
            fsm.apply({"op": "start_transfer", "transfer_id": f"t{tid}", "kind": ev[3], "from": ev[1], "to": ev[2], "now": now})
        elif ev[0] == "abort_xfer":
            fsm.apply({"op": "abort_transfer", "transfer_id": f"t{ev[1]}", "now": now})
        elif ev[0] == "abort":
            for t in list(fsm.transfers.values()):
                if t.cluster_id == ev[1]:
                    fsm.apply({"op": "abort_transfer", "transfer_id": t.transfer_id, "now": now})
        elif ev[0] == "round":
            for s, fail in zip(SHARDS, ev[1], strict=True):
                shards[s].process(fsm, fail)
                report(s, "ok")
        else:
            report(ev[1], ev[2])
        check()

    # Quiesce: no more failures or losses; everything in flight completes.
    for _ in range(20):
        for s in SHARDS:
            shards[s].process(fsm, False)
            report(s, "ok")
    assert not [t for t in fsm.transfers.values() if t.phase in (RELEASING, ADOPTING)]
    own = owners(shards)
    assert set(own) == all_machines and all(len(v) == 1 for v in own.values())
    for c in CLUSTERS:
        holder = fsm.bindings[c].shard_id
        for m in (f"{c}-m{j}" for j in range(2)):
            assert own[m] == [holder], (c, m, own[m], holder)
    assert sum(fsm.load.values()) == len(CLUSTERS)
