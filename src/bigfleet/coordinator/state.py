"""The coordinator's replicated state machine (pure: no I/O, no clock, no randomness).

Every change is a JSON-able command dict applied in log order on every
replica; the leader stamps times and ids into the command before proposing
it, so replicas stay identical. Commands are idempotent: a command retried
after a lost acknowledgement (pysyncobj can drop callbacks) changes nothing
the second time and answers the same way.

Tables: shards (membership + last heartbeat), cluster → shard bindings,
topology domain → shard, per-shard instruction queues (with a replicated
sequence counter), transfers (cluster handoffs and inventory moves) and the
coordinator members' addresses (for leader hints).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

# Error codes a command can answer with; the server maps them to gRPC codes.
OK = "ok"
NOT_FOUND = "not_found"
ALREADY_EXISTS = "already_exists"
INVALID = "invalid"
CONFLICT = "conflict"

# Ack outcomes (values of InstructAck.Outcome).
ACCEPTED = 1
REJECTED_STALE = 2
REJECTED_INVALID = 3
FAILED = 4

# Transfer kinds and phases.
KIND_CLUSTER = "cluster"
KIND_INVENTORY = "inventory"
KIND_DRAIN = "drain"
RELEASING = "releasing"
ADOPTING = "adopting"
DONE = "done"
ABORTED = "aborted"

# An adopt that keeps failing is retried this many times, then the machines
# are handed back to the releasing shard so none is left without an owner.
MAX_ADOPT_ATTEMPTS = 3
# Finished transfers kept for `ListTransfers` / `bigfleetctl`.
KEEP_FINISHED_TRANSFERS = 200


@dataclass
class ShardEntry:
    shard_id: str
    address: str
    provider_address: str
    registered_at_ns: int
    last_heartbeat_ns: int


@dataclass
class Binding:
    cluster_id: str
    shard_id: str
    bound_at_ns: int
    epoch: int = 1


@dataclass
class Instruction:
    instruction_id: str
    shard_id: str
    sequence: int
    # {"kind": "release_cluster" | "adopt_cluster" | "assign_domain" | ..., ...fields}
    payload: dict[str, Any]
    created_at_ns: int
    transfer_id: str = ""


@dataclass
class Transfer:
    transfer_id: str
    kind: str
    from_shard: str
    to_shard: str
    cluster_id: str = ""
    phase: str = RELEASING
    machine_ids: list[str] = field(default_factory=list)
    created_at_ns: int = 0
    updated_at_ns: int = 0
    reason: str = ""
    # Selector for inventory/drain transfers (JSON forms of the protos).
    requirements: list[dict[str, Any]] = field(default_factory=list)
    deficit: dict[str, str] = field(default_factory=dict)
    preemptor_priority: int = 0
    adopt_attempts: int = 0
    # Who adopts: normally to_shard; from_shard after repeated adopt failures.
    adopter: str = ""
    release_instruction: str = ""
    adopt_instruction: str = ""
    # Inventory/drain: the donor's free-machine count when it was asked, replaced by the
    # count on the report that answered if the answer handed over nothing. The rebalancer
    # re-asks a donor that came back empty once it has more free machines than this.
    # A plain default (not a factory) so Transfers unpickled from an older Raft dump read -1.
    donor_free: int = -1


@dataclass
class Member:
    node_id: str
    raft_address: str
    grpc_address: str


def domain_key(key: str, value: str) -> str:
    return f"{key}={value}"


class FleetState:
    """All replicated coordinator state. Mutate only through :meth:`apply`."""

    def __init__(self) -> None:
        self.shards: dict[str, ShardEntry] = {}
        self.bindings: dict[str, Binding] = {}
        # "key=value" -> (key, value, shard)
        self.domains: dict[str, tuple[str, str, str]] = {}
        self.queues: dict[str, dict[str, Instruction]] = {}
        self.transfers: dict[str, Transfer] = {}
        self.finished: list[str] = []
        self.members: dict[str, Member] = {}
        # cluster -> epoch of its binding dropped when its shard was removed: binding it again
        # continues from there, so a shard that once released the cluster to the removed one can
        # tell the new binding from the old (it serves again only for a newer epoch).
        self.retired_epochs: dict[str, int] = {}
        # Clusters bound per shard, kept in step with `bindings` (placement reads it per lookup).
        self.load: dict[str, int] = {}
        self.next_sequence = 1
        # Fencing floor carried across an offline restore: the exposed
        # coordinator term is term_offset + Raft term, so shards never see it regress.
        self.term_offset = 0
        # Mixed into instruction ids so ids minted after a restore never
        # collide with ids a shard already processed.
        self.incarnation = ""
        self.applied = 0

    # ------------------------------------------------------------------ apply
    def apply(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Apply one command; returns {"code": ..., ...}. Never raises on bad input."""
        op = cmd.get("op")
        handler = _HANDLERS.get(str(op))
        self.applied += 1
        if handler is None:
            return {"code": INVALID, "error": f"unknown op {op!r}"}
        try:
            result: dict[str, Any] = handler(self, cmd)
            return result
        except (KeyError, TypeError, ValueError) as exc:
            return {"code": INVALID, "error": f"{op}: {exc!r}"}

    # ---------------------------------------------------------------- helpers
    def _enqueue(self, shard_id: str, payload: dict[str, Any], now: int, transfer_id: str = "") -> Instruction:
        seq = self.next_sequence
        self.next_sequence += 1
        iid = hashlib.sha256(f"{self.incarnation}:{seq}".encode()).hexdigest()[:16]
        ins = Instruction(iid, shard_id, seq, payload, now, transfer_id)
        self.queues.setdefault(shard_id, {})[iid] = ins
        return ins

    def pending(self, shard_id: str) -> list[Instruction]:
        return sorted(self.queues.get(shard_id, {}).values(), key=lambda i: i.sequence)

    def active_transfer_for_cluster(self, cluster_id: str) -> Transfer | None:
        for t in self.transfers.values():
            if t.cluster_id == cluster_id and t.kind == KIND_CLUSTER and t.phase in (RELEASING, ADOPTING):
                return t
        return None

    def active_transfers(self) -> list[Transfer]:
        return [t for t in self.transfers.values() if t.phase in (RELEASING, ADOPTING)]

    def live_shards(self, now_ns: int, down_after_ns: int) -> list[str]:
        return sorted(s.shard_id for s in self.shards.values() if now_ns - s.last_heartbeat_ns <= down_after_ns)

    def _set_binding_shard(self, cluster_id: str, shard_id: str | None) -> None:
        b = self.bindings.get(cluster_id)
        if b is not None:
            self.load[b.shard_id] = self.load.get(b.shard_id, 0) - 1
            if self.load[b.shard_id] <= 0:
                del self.load[b.shard_id]
            if shard_id is None:
                del self.bindings[cluster_id]
            else:
                b.shard_id = shard_id
        if shard_id is not None:
            self.load[shard_id] = self.load.get(shard_id, 0) + 1

    def cluster_map(self) -> dict[str, str]:
        return {c: b.shard_id for c, b in self.bindings.items()}

    def _finish(self, t: Transfer, phase: str, now: int, reason: str = "") -> None:
        t.phase = phase
        t.updated_at_ns = now
        if reason:
            t.reason = reason
        self.finished.append(t.transfer_id)
        while len(self.finished) > KEEP_FINISHED_TRANSFERS:
            old = self.finished.pop(0)
            self.transfers.pop(old, None)

    def _hand_back(self, t: Transfer, now: int) -> None:
        """The releasing shard adopts what it released (and serves the cluster again, epoch +1)."""
        t.adopter = t.from_shard
        t.adopt_attempts = 0
        b = self.bindings.get(t.cluster_id) if t.kind == KIND_CLUSTER else None
        if b is not None and b.shard_id != t.from_shard:
            self._set_binding_shard(t.cluster_id, t.from_shard)
            b.epoch += 1
        self._send_adopt(t, now)

    def _send_adopt(self, t: Transfer, now: int) -> None:
        adopter = t.adopter or t.to_shard
        if t.kind == KIND_CLUSTER:
            b = self.bindings.get(t.cluster_id)
            payload: dict[str, Any] = {
                "kind": "adopt_cluster",
                "cluster_id": t.cluster_id,
                "handoff_id": t.transfer_id,
                "from_shard_id": t.from_shard,
                "machine_ids": list(t.machine_ids),
                "binding_epoch": b.epoch if b else 0,
            }
        else:
            payload = {
                "kind": "transfer_ownership",
                "machine_ids": list(t.machine_ids),
                "from_shard_id": t.from_shard,
                "to_shard_id": adopter,
                "transfer_id": t.transfer_id,
            }
        ins = self._enqueue(adopter, payload, now, t.transfer_id)
        t.adopt_instruction = ins.instruction_id
        t.adopt_attempts += 1

    # ------------------------------------------------------------- snapshots
    def to_json(self) -> dict[str, Any]:
        """The snapshot payload (upstream's three tables first, then ours)."""
        return {
            "shards": [asdict(s) for s in sorted(self.shards.values(), key=lambda s: s.shard_id)],
            "cluster_to_shard": {c: b.shard_id for c, b in sorted(self.bindings.items())},
            "domain_to_shard": [
                {"domain": {"Key": k, "Value": v}, "shard": s} for k, v, s in sorted(self.domains.values())
            ],
            "bindings": [asdict(b) for _, b in sorted(self.bindings.items())],
            "queues": {
                sid: [asdict(i) for i in sorted(q.values(), key=lambda i: i.sequence)]
                for sid, q in sorted(self.queues.items())
            },
            "transfers": [asdict(t) for _, t in sorted(self.transfers.items())],
            "finished": list(self.finished),
            "members": [asdict(m) for _, m in sorted(self.members.items())],
            "retired_epochs": dict(sorted(self.retired_epochs.items())),
            "next_sequence": self.next_sequence,
            "term_offset": self.term_offset,
            "incarnation": self.incarnation,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FleetState:
        st = cls()
        for s in data.get("shards", []):
            if "shard_id" in s:
                st.shards[s["shard_id"]] = ShardEntry(**s)
            else:  # upstream Go form {"ID","Address","RegisteredAt","LastHeartbeat"}
                st.shards[s["ID"]] = ShardEntry(s["ID"], s.get("Address", ""), "", 0, 0)
        if "bindings" in data:
            for b in data["bindings"]:
                st.bindings[b["cluster_id"]] = Binding(**b)
        else:
            for c, s in data.get("cluster_to_shard", {}).items():
                st.bindings[c] = Binding(c, s, 0)
        for d in data.get("domain_to_shard", []):
            k, v = d["domain"]["Key"], d["domain"]["Value"]
            st.domains[domain_key(k, v)] = (k, v, d["shard"])
        for sid, items in data.get("queues", {}).items():
            st.queues[sid] = {i["instruction_id"]: Instruction(**i) for i in items}
        for t in data.get("transfers", []):
            st.transfers[t["transfer_id"]] = Transfer(**t)
        st.finished = list(data.get("finished", []))
        for m in data.get("members", []):
            st.members[m["node_id"]] = Member(**m)
        st.retired_epochs = {str(c): int(e) for c, e in dict(data.get("retired_epochs", {})).items()}
        for b in st.bindings.values():
            st.load[b.shard_id] = st.load.get(b.shard_id, 0) + 1
        st.next_sequence = int(data.get("next_sequence", 1))
        st.term_offset = int(data.get("term_offset", 0))
        st.incarnation = str(data.get("incarnation", ""))
        return st

    def clone(self) -> FleetState:
        return copy.deepcopy(self)


# ---------------------------------------------------------------- commands
def _heartbeat(st: FleetState, cmd: dict[str, Any]) -> dict[str, Any]:
    sid = str(cmd["shard_id"])
    if not sid:
        return {"code": INVALID, "error": "shard_id required"}
    now = int(cmd["now"])
    e = st.shards.get(sid)
    if e is None:
        st.shards[sid] = ShardEntry(sid, str(cmd.get("address", "")), str(cmd.get("provider_address", "")), now, now)
        return {"code": OK, "registered": True}
    e.last_heartbeat_ns = max(e.last_heartbeat_ns, now)
    if cmd.get("address"):
        e.address = str(cmd["address"])
    if "provider_address" in cmd:
        e.provider_address = str(cmd["provider_address"])
    return {"code": OK, "registered": False}


def _remove_shard(st: FleetState, cmd: dict[str, Any]) -> dict[str, Any]:
    sid = str(cmd["shard_id"])
    now = int(cmd.get("now", 0))
    if sid not in st.shards:
        return {"code": NOT_FOUND, "error": f"shard {sid!r} not registered"}
    del st.shards[sid]
    st.queues.pop(sid, None)
    for t in st.active_transfers():
        if sid in (t.from_shard, t.to_shard, t.adopter):
            _transfer_without(st, t, sid, now)
    unbound = sorted(c for c, b in st.bindings.items() if b.shard_id == sid)
    for c in unbound:
        st.retired_epochs[c] = st.bindings[c].epoch
        st._set_binding_shard(c, None)
    for dk in [dk for dk, (_, _, s) in st.domains.items() if s == sid]:
        del st.domains[dk]
    return {"code": OK, "unbound_clusters": unbound}


def _transfer_without(st: FleetState, t: Transfer, sid: str, now: int) -> None:
    """A transfer one of whose shards was removed.

    Once the releasing shard has released (``adopting``) its machines are in nobody's inventory
    until an adoption lands, so aborting would lose them (and a released cluster is refused by its
    old shard for good): a live adopter still adopts them; a removed adopter's share goes back to
    the releasing shard. Before the release, or with both sides gone, the transfer is aborted; a
    release acknowledged after that is handed back by ``_ack``."""
    if t.phase == ADOPTING and (t.adopter or t.to_shard) != sid:
        return
    if t.phase == ADOPTING and t.from_shard != sid and t.from_shard in st.shards:
        t.reason = f"shard {sid} removed; returning machines to the releasing shard"
        t.updated_at_ns = now
        st._hand_back(t, now)
        return
    # Drop the other side's pending instruction for this transfer too.
    for q in st.queues.values():
        for iid in [iid for iid, i in q.items() if i.transfer_id == t.transfer_id]:
            del q[iid]
    st._finish(t, ABORTED, now, f"shard {sid} removed")


def _bind_cluster(st: FleetState, cmd: dict[str, Any]) -> dict[str, Any]:
    cid, sid = str(cmd["cluster_id"]), str(cmd["shard_id"])
    if not cid or not sid:
        return {"code": INVALID, "error": "cluster_id and shard_id required"}
    b = st.bindings.get(cid)
    if b is not None:
        # First contact wins; the answer names the real owner either way.
        return {"code": OK, "shard_id": b.shard_id, "epoch": b.epoch, "newly_bound": False}
    if sid not in st.shards:
        return {"code": NOT_FOUND, "error": f"shard {sid!r} not registered"}
    epoch = st.retired_epochs.pop(cid, 0) + 1
    st.bindings[cid] = Binding(cid, sid, int(cmd["now"]), epoch)
    st.load[sid] = st.load.get(sid, 0) + 1
    return {"code": OK, "shard_id": sid, "epoch": epoch, "newly_bound": True}


def _assign_domain(st: FleetState, cmd: dict[str, Any]) -> dict[str, Any]:
    k, v, sid = str(cmd["key"]), str(cmd["value"]), str(cmd["shard_id"])
    if not k or not v or not sid:
        return {"code": INVALID, "error": "topology_key, topology_value and shard_id required"}
    if sid not in st.shards:
        return {"code": NOT_FOUND, "error": f"shard {sid!r} not registered"}
    dk = domain_key(k, v)
    cur = st.domains.get(dk)
    if cur is not None:
        if cur[2] == sid:
            return {"code": OK, "changed": False}
        return {"code": ALREADY_EXISTS, "error": f"domain {dk} is assigned to {cur[2]}"}
    st.domains[dk] = (k, v, sid)
    st._enqueue(sid, {"kind": "assign_domain", "topology_key": k, "topology_value": v}, int(cmd.get("now", 0)))
    return {"code": OK, "changed": True}


def _unassign_domain(st: FleetState, cmd: dict[str, Any]) -> dict[str, Any]:
    k, v = str(cmd["key"]), str(cmd["value"])
    if not k or not v:
        return {"code": INVALID, "error": "topology_key and topology_value required"}
    cur = st.domains.pop(domain_key(k, v), None)
    if cur is not None and cur[2] in st.shards:
        st._enqueue(cur[2], {"kind": "unassign_domain", "topology_key": k, "topology_value": v}, int(cmd.get("now", 0)))
    return {"code": OK, "changed": cur is not None}


def _ack(st: FleetState, cmd: dict[str, Any]) -> dict[str, Any]:
    """A shard's instruction outcomes; ``free_machines`` (optional) is its free count on the same report."""
    sid = str(cmd["shard_id"])
    now = int(cmd["now"])
    q = st.queues.get(sid, {})
    cleared: list[str] = []
    for a in cmd.get("acks", []):
        iid, outcome = str(a["id"]), int(a["outcome"])
        ins = q.get(iid)
        if ins is None:
            # Already cleared (a duplicate ack), never ours, or the release of a transfer an
            # admin aborted: if that release did hand machines over, they go back to the releaser.
            late = next((t for t in st.transfers.values() if t.release_instruction == iid and t.phase == ABORTED), None)
            if late is not None and outcome == ACCEPTED and a.get("machine_ids") and late.from_shard == sid:
                late.machine_ids = sorted({str(m) for m in a.get("machine_ids", [])})
                late.adopter = late.from_shard
                late.adopt_attempts = 0
                late.phase = ADOPTING
                late.updated_at_ns = now
                late.reason = "aborted after release; returning machines to the releasing shard"
                if late.transfer_id in st.finished:
                    st.finished.remove(late.transfer_id)
                st._send_adopt(late, now)
            continue
        if outcome == REJECTED_STALE:
            continue  # a deposed leader's stamp; redeliver under the current term
        del q[iid]
        cleared.append(iid)
        t = st.transfers.get(ins.transfer_id) if ins.transfer_id else None
        if t is None or t.phase not in (RELEASING, ADOPTING):
            continue
        ok = outcome == ACCEPTED
        reason = str(a.get("reason", ""))
        if t.phase == RELEASING and iid == t.release_instruction:
            if t.kind != KIND_CLUSTER and not (ok and a.get("machine_ids")) and "free_machines" in cmd:
                t.donor_free = int(cmd["free_machines"])  # the baseline for asking this donor again
            if not ok:
                st._finish(t, ABORTED, now, f"release refused: {reason}")
                continue
            t.machine_ids = sorted({str(m) for m in a.get("machine_ids", [])})
            t.phase = ADOPTING
            t.updated_at_ns = now
            if t.kind == KIND_CLUSTER:
                b = st.bindings.get(t.cluster_id)
                if b is not None:
                    st._set_binding_shard(t.cluster_id, t.to_shard)
                    b.epoch += 1
                    b.bound_at_ns = now
            elif not t.machine_ids:
                st._finish(t, DONE, now, "donor released nothing")
                continue
            st._send_adopt(t, now)
        elif t.phase == ADOPTING and iid == t.adopt_instruction:
            if ok:
                st._finish(t, DONE, now)
                continue
            t.reason = f"adopt failed: {reason}"
            t.updated_at_ns = now
            if t.adopt_attempts < MAX_ADOPT_ATTEMPTS:
                st._send_adopt(t, now)
            elif t.adopter != t.from_shard and t.from_shard in st.shards:
                # Hand everything back to the releasing shard: no machine may be left ownerless.
                st._hand_back(t, now)
            else:
                st._finish(t, ABORTED, now, t.reason)
    return {"code": OK, "cleared": cleared}


def _start_handoffs(st: FleetState, cmd: dict[str, Any]) -> dict[str, Any]:
    now = int(cmd["now"])
    started: list[dict[str, str]] = []
    skipped: list[dict[str, str]] = []
    for m in cmd.get("moves", []):
        cid, frm, to = str(m["cluster_id"]), str(m["from"]), str(m["to"])
        tid = str(m["transfer_id"])
        b = st.bindings.get(cid)
        if tid in st.transfers:
            t = st.transfers[tid]
            started.append({"cluster_id": cid, "from": t.from_shard, "to": t.to_shard})  # idempotent retry
            continue
        why = ""
        if b is None or b.shard_id != frm:
            why = "binding changed"
        elif to not in st.shards or frm not in st.shards:
            why = "shard unknown"
        elif frm == to:
            why = "same shard"
        elif st.active_transfer_for_cluster(cid) is not None:
            why = "handoff already in flight"
        if why:
            skipped.append({"cluster_id": cid, "reason": why})
            continue
        t = Transfer(tid, KIND_CLUSTER, frm, to, cluster_id=cid, created_at_ns=now, updated_at_ns=now, adopter=to)
        st.transfers[tid] = t
        payload = {
            "kind": "release_cluster",
            "cluster_id": cid,
            "handoff_id": tid,
            "to_shard_id": to,
            "to_shard_address": st.shards[to].address,
            "binding_epoch": (b.epoch + 1) if b else 0,
        }
        t.release_instruction = st._enqueue(frm, payload, now, tid).instruction_id
        started.append({"cluster_id": cid, "from": frm, "to": to})
    return {"code": OK, "started": started, "skipped": skipped}


def _start_transfer(st: FleetState, cmd: dict[str, Any]) -> dict[str, Any]:
    now = int(cmd["now"])
    tid, kind = str(cmd["transfer_id"]), str(cmd["kind"])
    frm, to = str(cmd["from"]), str(cmd["to"])
    if tid in st.transfers:
        return {"code": OK, "started": False}
    if kind not in (KIND_INVENTORY, KIND_DRAIN):
        return {"code": INVALID, "error": f"bad transfer kind {kind!r}"}
    if frm not in st.shards or to not in st.shards or frm == to:
        return {"code": NOT_FOUND, "error": "donor or recipient unknown"}
    for t in st.active_transfers():
        if t.kind != KIND_CLUSTER and (t.to_shard == to or t.from_shard == frm):
            return {"code": CONFLICT, "error": "a transfer for this donor or recipient is in flight"}
    t = Transfer(
        tid,
        kind,
        frm,
        to,
        created_at_ns=now,
        updated_at_ns=now,
        requirements=list(cmd.get("requirements", [])),
        deficit=dict(cmd.get("deficit", {})),
        preemptor_priority=int(cmd.get("preemptor_priority", 0)),
        adopter=to,
        donor_free=int(cmd.get("donor_free", -1)),
    )
    st.transfers[tid] = t
    # (the min unit travels in the instruction only: the Transfer record does not need it)
    common = {"to_shard_id": to, "transfer_id": tid, "requirements": t.requirements, "deficit": t.deficit,
              "min_unit": dict(cmd.get("min_unit", {}))}
    if kind == KIND_INVENTORY:
        payload: dict[str, Any] = {"kind": "transfer_ownership", "machine_ids": [], "from_shard_id": frm, **common}
    else:
        payload = {"kind": "cross_shard_drain", "machine_ids": [], "preemptor_priority": t.preemptor_priority, **common}
    t.release_instruction = st._enqueue(frm, payload, now, tid).instruction_id
    return {"code": OK, "started": True}


def _abort_transfer(st: FleetState, cmd: dict[str, Any]) -> dict[str, Any]:
    tid = str(cmd["transfer_id"])
    now = int(cmd.get("now", 0))
    t = st.transfers.get(tid)
    if t is None:
        return {"code": NOT_FOUND, "error": f"no transfer {tid!r}"}
    if t.phase in (DONE, ABORTED):
        return {"code": OK, "phase": t.phase}
    if t.phase == ADOPTING:
        return {"code": CONFLICT, "error": "machines were released; the adoption must complete"}
    q = st.queues.get(t.from_shard, {})
    q.pop(t.release_instruction, None)
    st._finish(t, ABORTED, now, str(cmd.get("reason", "aborted by admin")))
    return {"code": OK, "phase": t.phase}


def _register_member(st: FleetState, cmd: dict[str, Any]) -> dict[str, Any]:
    m = Member(str(cmd["node_id"]), str(cmd["raft_address"]), str(cmd["grpc_address"]))
    if not m.node_id:
        return {"code": INVALID, "error": "node_id required"}
    st.members[m.node_id] = m
    return {"code": OK}


def _restore(st: FleetState, cmd: dict[str, Any]) -> dict[str, Any]:
    """Replace everything with a snapshot's tables (offline restore's first write)."""
    if cmd.get("incarnation") and cmd.get("incarnation") == st.incarnation:
        return {"code": OK, "already": True}  # a retried restore must not wipe later writes
    if not isinstance(cmd.get("state"), dict):
        return {"code": INVALID, "error": "restore: state must be an object"}
    new = FleetState.from_json(cmd["state"])
    new.term_offset = max(new.term_offset, int(cmd.get("term_offset", 0)))
    new.incarnation = str(cmd.get("incarnation", new.incarnation))
    applied = st.applied
    st.__dict__.update(new.__dict__)
    st.applied = applied
    return {"code": OK}


def _noop(st: FleetState, cmd: dict[str, Any]) -> dict[str, Any]:
    return {"code": OK}


_HANDLERS: dict[str, Any] = {
    "heartbeat": _heartbeat,
    "remove_shard": _remove_shard,
    "bind_cluster": _bind_cluster,
    "assign_domain": _assign_domain,
    "unassign_domain": _unassign_domain,
    "ack": _ack,
    "start_handoffs": _start_handoffs,
    "start_transfer": _start_transfer,
    "abort_transfer": _abort_transfer,
    "register_member": _register_member,
    "restore": _restore,
    "noop": _noop,
}
