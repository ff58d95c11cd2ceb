"""The provider contract as a pure state machine: no I/O, no clock, no threads.

Every rule a conformant provider follows lives here: the four legal edges,
fencing with a high-water mark per (shard, machine), idempotency keyed on
(machine, kind) with stable operation ids, store-and-echo of the binding,
revisions for incremental List, restart recovery. The gRPC server and the
in-process simulator are thin shells that call these methods and do the
substrate work; the randomness List needs is passed in.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc

from bigfleet.provider.kit.model import (
    TRANSITIONAL,
    Fence,
    HostRef,
    Instance,
    InvalidRecord,
    Kind,
    KitError,
    MachineRecord,
    State,
    record_from_instance,
    validate_instance,
)

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
MAX_ID_BYTES = 4096
MAX_METADATA_BYTES = 8 << 20
MAX_METADATA_ENTRIES = 65536
#: ConfigureRequest.bootstrap_blob: 1 MiB, the bound the shard puts on the operator's
#: BootstrapBlobResponse.user_data it forwards (docs/security.md; cloud user-data is 16-256 KiB).
MAX_BLOB_BYTES = 1 << 20

_DECIMAL = re.compile(rb"[+-]?[0-9]+")

SNAPSHOT_VERSION = 1


def parse_revision(cursor: bytes) -> int | None:
    """Strict base-10 int64, or None (a malformed cursor means 'no cursor', never an error)."""
    if not cursor or len(cursor) > 20 or not _DECIMAL.fullmatch(cursor):
        return None
    value = int(cursor)
    if not INT64_MIN <= value <= INT64_MAX:
        return None
    return value


@dataclass(frozen=True)
class Ack:
    """The answer to an accepted lifecycle call."""

    operation_id: str
    machine: MachineRecord  # a private copy, safe to hand out
    started: bool  # True: a new transition began and the shell must run the substrate work


def _check_id(value: str, what: str) -> None:
    if not value:
        raise KitError(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is empty")
    if len(value.encode()) > MAX_ID_BYTES:
        raise KitError(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is longer than {MAX_ID_BYTES} bytes")


def check_configure_args(cluster_id: str, metadata: Mapping[str, str], blob_len: int) -> None:
    """Configure-specific validation, run before fencing so a malformed call changes nothing."""
    _check_id(cluster_id, "cluster_id")
    if not cluster_id.isprintable() or any(c.isspace() for c in cluster_id):
        # the shard's cluster-id rule; the id lands in node labels and bootstrap scripts
        raise KitError(grpc.StatusCode.INVALID_ARGUMENT, "cluster_id contains whitespace or control characters")
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise KitError(grpc.StatusCode.INVALID_ARGUMENT, f"shard_metadata has more than {MAX_METADATA_ENTRIES} entries")
    size = 0
    for k, v in metadata.items():
        size += len(k.encode()) + len(v.encode())
    if size > MAX_METADATA_BYTES:
        raise KitError(grpc.StatusCode.INVALID_ARGUMENT, f"shard_metadata is larger than {MAX_METADATA_BYTES} bytes")
    if blob_len > MAX_BLOB_BYTES:
        raise KitError(grpc.StatusCode.INVALID_ARGUMENT,
                       f"bootstrap_blob is {blob_len} bytes, limit {MAX_BLOB_BYTES} (1 MiB)")


def check_token(fence: Fence) -> None:
    if len(fence.shard_id.encode()) > MAX_ID_BYTES:
        raise KitError(grpc.StatusCode.INVALID_ARGUMENT, "shard_id is too long")
    for v, what in ((fence.epoch, "shard_epoch"), (fence.sequence, "sequence_number")):
        if not INT64_MIN <= v <= INT64_MAX:
            raise KitError(grpc.StatusCode.INVALID_ARGUMENT, f"{what} out of int64 range")


class ProviderCore:
    """All provider state and every contract rule; callers serialise access (one event loop or one lock)."""

    def __init__(self, op_prefix: str = "op", supports_delete: bool = True) -> None:
        self.op_prefix = op_prefix
        self.supports_delete = supports_delete
        self.machines: dict[str, MachineRecord] = {}
        self.fences: dict[tuple[str, str], tuple[int, int]] = {}
        self.ops: dict[tuple[str, Kind], str] = {}
        self.rev = 0
        self.next_op = 1
        # Machine ids in the order they last changed, with that revision: an incremental List reads
        # only what changed (newest first) instead of scanning the fleet. Trusted only while every
        # revision bump went through _bump (``_indexed_rev == rev``); otherwise List scans.
        self._order: dict[str, int] = {}
        self._indexed_rev = 0
        # Bumped on every change that must reach the store (including a fence mark
        # advanced by a call that is then rejected).
        self.changes = 0
        # What changed since the last take_delta(), for journaling stores.
        self._dirty_m: set[str] = set()
        self._dirty_f: set[tuple[str, str]] = set()
        self._dirty_o: set[tuple[str, Kind]] = set()

    def _bump(self, rec: MachineRecord, shape_changed: bool = False) -> None:
        """Every change of a machine: next revision, the record's cache, the change-order index."""
        self.rev += 1
        rec.touch(self.rev, shape_changed=shape_changed)
        order = self._order
        order.pop(rec.id, None)
        order[rec.id] = self.rev
        self._indexed_rev = self.rev

    # ---- bootstrap -------------------------------------------------------------------------------

    @property
    def is_fresh(self) -> bool:
        return not self.machines and not self.fences and not self.ops and self.rev == 0

    def seed(self, instances: Iterable[Instance], require_zone: bool = False) -> int:
        """Add backend records on first boot; every record is validated, duplicates refused."""
        added: list[MachineRecord] = []
        seen = set(self.machines)
        for inst in instances:
            state = validate_instance(inst, require_zone)
            if inst.id in seen:
                raise InvalidRecord(f"duplicate machine id {inst.id!r}")
            seen.add(inst.id)
            added.append(record_from_instance(inst, state))
        for rec in added:
            self.machines[rec.id] = rec
            self._bump(rec)
            self._dirty_m.add(rec.id)
        if added:
            self.changes += 1
        return len(added)

    def reconcile(self, instances: Iterable[Instance], require_zone: bool = False) -> tuple[int, list[str]]:
        """Fold a fresh Describe in: add unknown ids, refresh cost/shape fields of known ones.

        Identity (instance type, zone) and everything the kit owns (state, host,
        binding, last_error) are never touched. Invalid records are skipped and
        reported, never applied.
        """
        changed = 0
        skipped: list[str] = []
        for inst in instances:
            try:
                state = validate_instance(inst, require_zone)
            except InvalidRecord as exc:
                skipped.append(str(exc))
                continue
            rec = self.machines.get(inst.id)
            if rec is None:
                rec = record_from_instance(inst, state)
                self.machines[rec.id] = rec
            else:
                fresh = (float(inst.price_per_hour), float(inst.interruption_probability), dict(inst.resources),
                         dict(inst.allocatable), dict(inst.labels))
                if fresh == (rec.price_per_hour, rec.interruption_probability, rec.resources, rec.allocatable,
                             rec.labels):
                    continue
                (rec.price_per_hour, rec.interruption_probability, rec.resources, rec.allocatable,
                 rec.labels) = fresh
            self._bump(rec, shape_changed=True)
            self._dirty_m.add(rec.id)
            changed += 1
        if changed:
            self.changes += 1
        return changed, skipped

    def recover_interrupted(self) -> list[str]:
        """After a restart nothing is running: every transitional machine becomes FAILED."""
        ids = []
        for rec in self.machines.values():
            if rec.state in TRANSITIONAL:
                kind = next(k for k in Kind if k.transitional == rec.state)
                rec.state = State.FAILED
                rec.last_error = f"{kind.value} transition interrupted by a provider restart; needs re-drive"
                rec.op_id = ""
                self._bump(rec)
                self._dirty_m.add(rec.id)
                ids.append(rec.id)
        if ids:
            self.changes += 1
        return ids

    # ---- lifecycle -------------------------------------------------------------------------------

    def mutate(
        self,
        kind: Kind,
        machine_id: str,
        fence: Fence,
        cluster_id: str = "",
        metadata: Mapping[str, str] | None = None,
    ) -> Ack:
        """One lifecycle call, in the contract's order; raises KitError with the status to answer."""
        _check_id(machine_id, "machine_id")
        check_token(fence)
        if kind == Kind.DELETE and not self.supports_delete:
            raise KitError(grpc.StatusCode.UNIMPLEMENTED, "this provider does not implement Delete")
        if not fence.is_zero:
            key = (fence.shard_id, machine_id)
            mark = self.fences.get(key)
            token = (fence.epoch, fence.sequence)
            if mark is not None and token <= mark:
                raise KitError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"fenced: token {token} for shard {fence.shard_id!r} is not newer than {mark}",
                )
            self.fences[key] = token
            self._dirty_f.add(key)
            self.changes += 1
        rec = self.machines.get(machine_id)
        if rec is None:
            raise KitError(grpc.StatusCode.NOT_FOUND, f"machine {machine_id!r} not found")
        prior = self.ops.get((machine_id, kind))
        if prior and rec.state in (kind.transitional, kind.target):
            if kind == Kind.CONFIGURE and rec.cluster != cluster_id:
                raise KitError(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"machine {machine_id!r} is bound to another cluster; drain it first",
                )
            return Ack(prior, rec.copy(), started=False)
        if rec.state != kind.source:
            raise KitError(
                grpc.StatusCode.INTERNAL,
                f"invalid transition: {kind.value} needs {kind.source.name}, machine {machine_id!r} is {rec.state.name}",
            )
        op_id = f"{self.op_prefix}-{self.next_op}"
        self.next_op += 1
        self.ops[(machine_id, kind)] = op_id
        self._dirty_o.add((machine_id, kind))
        # Only a machine's latest transition can be repeated: once another one starts, an older
        # operation (e.g. a Drain from before a Delete and a new Create) is no longer a replay.
        # An empty id is the tombstone, so the journal carries the forgetting too.
        for other in Kind:
            if other != kind and self.ops.get((machine_id, other)):
                self.ops[(machine_id, other)] = ""
                self._dirty_o.add((machine_id, other))
        self._dirty_m.add(machine_id)
        rec.state = kind.transitional
        rec.op_id = op_id
        if kind == Kind.CONFIGURE:
            rec.cluster = cluster_id
            rec.shard_metadata = dict(metadata or {})
        self._bump(rec)
        self.changes += 1
        return Ack(op_id, rec.copy(), started=True)

    def complete(
        self,
        machine_id: str,
        kind: Kind,
        op_id: str,
        error: str | None = None,
        host: HostRef | None = None,
        resources: Mapping[str, str] | None = None,
        allocatable: Mapping[str, str] | None = None,
    ) -> bool:
        """Apply the outcome of substrate work; returns False when it is stale and was dropped."""
        rec = self.machines.get(machine_id)
        if rec is None or rec.state != kind.transitional or rec.op_id != op_id:
            return False
        if error is None and kind == Kind.CREATE and (host is None or host.empty):
            error = "create returned no host"
        if error is not None:
            rec.state = State.FAILED
            rec.last_error = error or f"{kind.value} failed"
        else:
            rec.state = kind.target
            if kind == Kind.CREATE:
                assert host is not None
                rec.host = HostRef(host.provider, host.ref)
                if resources is not None:
                    rec.resources = dict(resources)
                if allocatable is not None:
                    rec.allocatable = dict(allocatable)
            elif kind == Kind.DRAIN:
                rec.cluster = ""
                rec.shard_metadata = {}
            elif kind == Kind.DELETE:
                rec.host = HostRef()
                rec.cluster = ""
                rec.shard_metadata = {}
        rec.op_id = ""
        self._bump(rec, shape_changed=error is None and (resources is not None or allocatable is not None))
        self._dirty_m.add(machine_id)
        self.changes += 1
        return True

    def in_flight(self) -> list[tuple[str, Kind, str]]:
        out = []
        for rec in self.machines.values():
            if rec.state in TRANSITIONAL:
                kind = next(k for k in Kind if k.transitional == rec.state)
                out.append((rec.id, kind, rec.op_id))
        return out

    # ---- reads -----------------------------------------------------------------------------------

    def get(self, machine_id: str) -> MachineRecord:
        _check_id(machine_id, "id")
        rec = self.machines.get(machine_id)
        if rec is None:
            raise KitError(grpc.StatusCode.NOT_FOUND, f"machine {machine_id!r} not found")
        return rec

    def list(
        self,
        states: Sequence[int],
        max_results: int,
        since_revision: bytes,
        rng: random.Random,
    ) -> tuple[list[MachineRecord], int]:
        """Machines matching the filter, in a randomised order, plus the current revision.

        The order varies between calls on purpose: callers that pick "the first
        speculative machine" must not all collide on the same one.
        """
        wanted: set[State] = set()
        for s in states:
            if s not in State.__members__.values() or s == State.UNSPECIFIED:
                raise KitError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown machine state {s} in filter")
            wanted.add(State(s))
        if max_results < 0:
            raise KitError(grpc.StatusCode.INVALID_ARGUMENT, "max_results must be >= 0")
        since = parse_revision(since_revision)
        if since is not None and since > self.rev:
            since = None  # a cursor this provider never issued (e.g. from before a restart that lost state): unknown
        if since is not None and self._indexed_rev == self.rev:
            records = []
            machines = self.machines
            for mid, r in reversed(self._order.items()):
                if r <= since:
                    break
                rec = machines.get(mid)
                if rec is not None and rec.modified > since:
                    records.append(rec)
        else:
            records = list(self.machines.values())
        n = len(records)
        out: list[MachineRecord] = []
        if n and not wanted and since is None and not max_results:
            start = rng.randrange(n)
            return records[start:] + records[:start], self.rev
        if n:
            start = rng.randrange(n)
            for i in range(n):
                rec = records[(start + i) % n]
                if wanted and rec.state not in wanted:
                    continue
                if since is not None and rec.modified <= since:
                    continue
                out.append(rec)
                if max_results and len(out) >= max_results:
                    break
        return out, self.rev

    # ---- persistence -----------------------------------------------------------------------------

    def take_delta(self) -> dict[str, object]:
        """What changed since the last delta or snapshot, as upserts (replaying one twice is harmless)."""
        d: dict[str, object] = {
            "changes": self.changes,
            "rev": self.rev,
            "next_op": self.next_op,
            "machines": [self.machines[m].to_json() for m in self._dirty_m if m in self.machines],
            "fences": [
                {"shard_id": s, "machine_id": m, "epoch": self.fences[(s, m)][0], "sequence": self.fences[(s, m)][1]}
                for (s, m) in self._dirty_f
            ],
            "ops": [{"machine_id": m, "kind": k.value, "operation_id": self.ops[(m, k)]} for (m, k) in self._dirty_o],
        }
        self._clear_dirty()
        return d

    def _clear_dirty(self) -> None:
        self._dirty_m = set()
        self._dirty_f = set()
        self._dirty_o = set()

    def snapshot(self) -> dict[str, object]:
        self._clear_dirty()
        return {
            "version": SNAPSHOT_VERSION,
            "changes": self.changes,
            "rev": self.rev,
            "next_op": self.next_op,
            "machines": [m.to_json() for m in self.machines.values()],
            "fences": [
                {"shard_id": s, "machine_id": m, "epoch": e, "sequence": q} for (s, m), (e, q) in self.fences.items()
            ],
            "ops": [{"machine_id": m, "kind": k.value, "operation_id": o} for (m, k), o in self.ops.items() if o],
        }

    def restore(self, snap: Mapping[str, object]) -> None:
        """Load a snapshot; every machine counts as modified at the stored revision."""
        version = snap.get("version", SNAPSHOT_VERSION)
        if version != SNAPSHOT_VERSION:
            raise ValueError(f"unsupported state snapshot version {version!r}")
        rev = int(snap.get("rev", 0))  # type: ignore[call-overload]
        machines: dict[str, MachineRecord] = {}
        for d in snap.get("machines", []) or []:  # type: ignore[attr-defined]
            rec = MachineRecord.from_json(d)
            rec.modified = rev
            if rec.id in machines:
                raise ValueError(f"duplicate machine {rec.id!r} in state snapshot")
            machines[rec.id] = rec
        fences = {
            (str(f["shard_id"]), str(f["machine_id"])): (int(f["epoch"]), int(f["sequence"]))
            for f in snap.get("fences", []) or []  # type: ignore[attr-defined]
        }
        ops = {
            (str(o["machine_id"]), Kind(o["kind"])): str(o["operation_id"])
            for o in snap.get("ops", []) or []  # type: ignore[attr-defined]
            if o["operation_id"]
        }
        self.machines, self.fences, self.ops = machines, fences, ops
        self.rev = rev
        self._order = {mid: rec.modified for mid, rec in machines.items()}
        self._indexed_rev = rev
        self.next_op = int(snap.get("next_op", 1))  # type: ignore[call-overload]
        self.changes = int(snap.get("changes", 0))  # type: ignore[call-overload]
        self._clear_dirty()
