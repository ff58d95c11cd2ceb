"""`Inventory`: every machine a shard knows, indexed by id, state, cluster and labels.

The only writer of machine records; every write checks the structural invariant and (for
transitions) the state machine, so a bad write cannot leave a machine in two places or lose one.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, ValuesView
from itertools import chain
from types import MappingProxyType
from typing import Any

from bigfleet.machine.labels import Labels
from bigfleet.machine.record import Assignment, Machine, MachineShape
from bigfleet.machine.state import ALL_STATES, MachineState, check_transition
from bigfleet.machine.validate import check_invariant

#: every NaN penalty stamp is reported as this one object (a set finds a NaN by identity only)
_NAN = float("nan")

#: the most writes `Inventory.replaced_since` journals between two calls (it keeps the replaced
#: records alive until then; a consumer that stops asking must not pin memory)
_JOURNAL_CAP = 1 << 16


class UnknownMachine(KeyError):
    """No machine with that id is in the inventory."""


class DuplicateMachine(ValueError):
    """`Inventory.add` of an id that is already present."""


class _Bucket(dict[str, Machine]):
    """One (state, shape) group's id → record table, plus what the engine's cold index build would
    otherwise read every record for, kept at O(1) a write without hashing a shape or an assignment:
    whether ids were inserted in ascending order, and the distinct assignment objects' counts."""

    __slots__ = ("ordered", "stamps")

    def __init__(self) -> None:
        super().__init__()
        self.ordered = True
        #: id(assignment) → [assignment, machines carrying it] (records hold the objects, so ids stay valid)
        self.stamps: dict[int, list[Any]] = {}

    def clone(self) -> _Bucket:
        b = _Bucket()
        b.update(self)
        b.ordered = self.ordered
        b.stamps = {k: list(v) for k, v in self.stamps.items()}
        return b


class ShapeGroup(Collection[Machine]):
    """Live, read-only view of the machines of one shape in one state. `id_ordered`: they iterate in
    ascending id order (the inventory tracks that per group at O(1) a write, so a consumer needing
    id order, like the decision engine's cold index build, can skip a sort that reads every record)."""

    __slots__ = ("_g", "assignments", "id_ordered")

    def __init__(self, g: _Bucket) -> None:
        self._g = g
        self.id_ordered = g.ordered
        #: the distinct stamped assignment objects of these machines: what they were stamped with,
        #: known without reading every record (the engine's penalty orders and victim scores)
        self.assignments: list[Assignment] = [v[0] for v in g.stamps.values()]

    @property
    def reclamation_penalties(self) -> set[float]:
        """The distinct stamped reclamation penalties (any NaN as one NaN)."""
        return {p if p == p else _NAN for p in (a.reclamation_penalty_dollars for a in self.assignments)}

    def __len__(self) -> int:
        return len(self._g)

    def __iter__(self) -> Iterator[Machine]:
        return iter(self._g.values())

    def __contains__(self, m: object) -> bool:
        return isinstance(m, Machine) and self._g.get(m.id) is m


class StateView(Collection[Machine]):
    """Live, read-only view of the machines in one state (grouped by shape internally)."""

    __slots__ = ("_groups",)

    def __init__(self, groups: dict[MachineShape, _Bucket]) -> None:
        self._groups = groups

    def __len__(self) -> int:
        return sum(len(g) for g in self._groups.values())

    def __iter__(self) -> Iterator[Machine]:
        return chain.from_iterable(g.values() for g in self._groups.values())

    def __contains__(self, m: object) -> bool:
        if not isinstance(m, Machine):
            return False
        g = self._groups.get(m.shape)
        return g is not None and g.get(m.id) is m

    def by_labels(self) -> list[tuple[Labels, Collection[Machine]]]:
        """``(match labels, machines)`` per distinct label set: match requirements once per set."""
        merged: dict[Labels, list[ValuesView[Machine]]] = {}
        for shape, g in self._groups.items():
            merged.setdefault(shape.match_labels, []).append(g.values())
        return [(lab, vs[0] if len(vs) == 1 else list(chain.from_iterable(vs))) for lab, vs in merged.items()]

    def by_shape(self) -> list[tuple[MachineShape, ShapeGroup]]:
        """``(shape, machines)`` per distinct shape: every machine of a group is interchangeable, so a
        consumer (the decision engine's index) can file a whole group at once."""
        return [(shape, ShapeGroup(g)) for shape, g in self._groups.items()]


class Inventory:
    """Machines by id plus indexes by state (and, within a state, by shared shape) and by cluster.

    One index entry per machine for state+shape (the shape is shared by every machine of a type, so
    grouping by it costs nothing extra), one more for bound machines' cluster. Views returned
    by `by_state` are live; copy them before mutating the inventory while iterating.
    """

    __slots__ = ("_by_cluster", "_by_state", "_generation", "_journal", "_journal_gen", "_journal_ids", "_machines")

    def __init__(self, machines: Iterable[Machine] = ()) -> None:
        self._machines: dict[str, Machine] = {}
        self._by_state: dict[MachineState, dict[MachineShape, _Bucket]] = {s: {} for s in MachineState}
        self._by_cluster: dict[str, dict[str, Machine]] = {}
        self._generation = 0
        #: the record each write since `_journal_gen` replaced (None: it added one), in write order;
        #: None when not kept (nobody asked, or a removal, a second write of one id or the cap ended it)
        self._journal: list[Machine | None] | None = None
        self._journal_gen = -1
        self._journal_ids: set[str] = set()
        for m in machines:
            self.add(m)

    # --- writes -------------------------------------------------------------------------------

    def add(self, m: Machine) -> Machine:
        """Insert a new machine (invariant checked); `DuplicateMachine` if the id exists."""
        if m.id in self._machines:
            raise DuplicateMachine(f"machine {m.id!r} already in inventory")
        check_invariant(m)
        self._store(m, None)
        return m

    def upsert(self, m: Machine, now_unix_nanos: int | None = None, *, check_state: bool = False) -> Machine:
        """Insert or replace `m` (the provider's view wins); returns the stored record.

        The invariant is always checked; the transition only when `check_state` is set (reconcile may
        legitimately observe jumps an asynchronous provider made unseen). Staying in the same state
        keeps the original ``state_since_unix_nanos``; entering a state stamps `now_unix_nanos`
        unless the record carries its own stamp.
        """
        check_invariant(m)
        old = self._machines.get(m.id)
        if old is not None:
            if old.state is m.state:
                if m.state_since_unix_nanos != old.state_since_unix_nanos:
                    m = m.replace(state_since_unix_nanos=old.state_since_unix_nanos)
            else:
                if check_state:
                    check_transition(old.state, m.state, m.id)
                if now_unix_nanos is not None and not m.state_since_unix_nanos:
                    m = m.replace(state_since_unix_nanos=now_unix_nanos)
            if old == m:
                return old
        elif now_unix_nanos is not None and not m.state_since_unix_nanos:
            m = m.replace(state_since_unix_nanos=now_unix_nanos)
        self._store(m, old)
        return m

    def apply(self, m: Machine, now_unix_nanos: int | None = None) -> Machine:
        """`upsert` with the transition check (for the shard's own lifecycle walks)."""
        return self.upsert(m, now_unix_nanos, check_state=True)

    def transition(self, machine_id: str, new_state: MachineState, now_unix_nanos: int, **changes: Any) -> Machine:
        """Move a machine to `new_state` (validated against `TRANSITIONS`), applying `changes`.

        `changes` are `Machine.replace` keywords (``cluster=...``, ``assigned_priority=...``). Raises
        `UnknownMachine`, `IllegalTransition` or `ValidationError`; on error nothing changes.
        """
        old = self._machines.get(machine_id)
        if old is None:
            raise UnknownMachine(machine_id)
        check_transition(old.state, new_state, machine_id)
        new = old.replace(state=new_state, state_since_unix_nanos=now_unix_nanos, **changes)
        check_invariant(new)
        self._store(new, old)
        return new

    def update(self, machine_id: str, **changes: Any) -> Machine:
        """Change fields without a state change (a merge); the invariant is still checked."""
        old = self._machines.get(machine_id)
        if old is None:
            raise UnknownMachine(machine_id)
        if "state" in changes and changes["state"] is not old.state:
            raise ValueError("use transition() to change state")
        new = old.replace(**changes)
        check_invariant(new)
        self._store(new, old)
        return new

    def remove(self, machine_id: str) -> Machine | None:
        """Forget a machine; returns it, or None if it was not present."""
        old = self._machines.get(machine_id)
        if old is None:
            return None
        self._forget(old)
        return old

    # (the only two places records enter or leave the tables: a subclass writing unchecked calls these)

    def _store(self, m: Machine, old: Machine | None) -> None:
        """Write `m` over `old` (None: a new id), already checked: journal, tables, generation."""
        j = self._journal
        if j is not None:
            if m.id in self._journal_ids or len(j) >= _JOURNAL_CAP:
                self._journal = None
                self._journal_ids = set()
            else:
                self._journal_ids.add(m.id)
                j.append(old)
        if old is not None:
            self._unindex(old)
        self._index(m)
        self._generation += 1

    def _forget(self, old: Machine) -> None:
        self._journal = None  # (the write-order tail no longer holds every change)
        self._unindex(old)
        self._generation += 1

    def replaced_since(self, generation: int) -> list[Machine | None] | None:
        """What each write since `generation` replaced (None: the write added the record), in write
        order: the records written since are then exactly the last that many of `machines()`, in the
        same order. None when unknown: `generation` is not where the journal starts, or since then a
        machine was removed or written twice, or the journal reached its cap. Starts a new journal at
        the current generation, so an incremental consumer (the engine's index) calls this once per
        sync and finds what changed without looking a single id up."""
        j = self._journal
        out = j if j is not None and self._journal_gen == generation else None
        self._journal = []
        self._journal_ids = set()
        self._journal_gen = self._generation
        return out

    def _index(self, m: Machine) -> None:
        mid = m.id
        self._machines[mid] = m
        groups = self._by_state[m.state]
        shape = m.shape
        bucket = groups.get(shape)
        if bucket is None:
            bucket = groups[shape] = _Bucket()
        elif bucket.ordered and mid < next(reversed(bucket)):  # (the last key, O(1))
            bucket.ordered = False
        bucket[mid] = m
        a = m.assignment
        got = bucket.stamps.get(id(a))
        if got is None:
            bucket.stamps[id(a)] = [a, 1]
        else:
            got[1] += 1
        if m.cluster:
            c = self._by_cluster.get(m.cluster)
            if c is None:
                c = self._by_cluster[m.cluster] = {}
            c[mid] = m

    def _unindex(self, m: Machine) -> None:
        mid = m.id
        del self._machines[mid]
        groups = self._by_state[m.state]
        shape = m.shape
        bucket = groups[shape]
        del bucket[mid]
        if not bucket:
            del groups[shape]
        else:
            k = id(m.assignment)  # (the very object counted in `_index`)
            got = bucket.stamps[k]
            got[1] -= 1
            if not got[1]:
                del bucket.stamps[k]
        if m.cluster:
            c = self._by_cluster[m.cluster]
            del c[mid]
            if not c:
                del self._by_cluster[m.cluster]

    # --- reads --------------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """Increments on every change (for incremental consumers and cache invalidation)."""
        return self._generation

    def get(self, machine_id: str) -> Machine | None:
        return self._machines.get(machine_id)

    def __getitem__(self, machine_id: str) -> Machine:
        try:
            return self._machines[machine_id]
        except KeyError:
            raise UnknownMachine(machine_id) from None

    def __contains__(self, machine_id: object) -> bool:
        return machine_id in self._machines

    def __len__(self) -> int:
        return len(self._machines)

    def __iter__(self) -> Iterator[Machine]:
        return iter(self._machines.values())

    def machines(self) -> ValuesView[Machine]:
        """Every machine, in write order: each write (add, upsert/apply that changes something,
        transition, update) re-inserts the record at the end, and a no-op upsert leaves it in place.
        Incremental consumers (the decision engine's index) rely on this: the records written since
        a point are exactly the tail not seen before."""
        return self._machines.values()

    def id_table(self) -> dict[str, Machine]:
        """A copy of the id → record table: one C-level table copy, far cheaper than building the
        same dict from the records (which touches every record: ~20x slower at 500 000)."""
        return self._machines.copy()

    def id_map(self) -> Mapping[str, Machine]:
        """A read-only live view of the id → record table (no copy)."""
        return MappingProxyType(self._machines)

    def ids(self) -> list[str]:
        """Every id, sorted."""
        return sorted(self._machines)

    def by_state(self, state: MachineState) -> StateView:
        """Machines in `state` (live view; no particular order, sort by id if order matters)."""
        return StateView(self._by_state[state])

    def by_cluster(self, cluster_id: str, state: MachineState | None = None) -> list[Machine]:
        """Machines bound to `cluster_id` (optionally only those in `state`)."""
        c = self._by_cluster.get(cluster_id)
        if not c:
            return []
        if state is None:
            return list(c.values())
        return [m for m in c.values() if m.state is state]

    def by_label(self, key: str, value: str | None = None) -> list[Machine]:
        """Machines whose match labels (labels + instance type + zone) have `key` (= `value` if given)."""
        out: list[Machine] = []
        for groups in self._by_state.values():
            for shape, bucket in groups.items():
                v = shape.match_labels.get(key)
                if v is not None and (value is None or v == value):
                    out.extend(bucket.values())
        return out

    def label_sets(self) -> list[tuple[Labels, int]]:
        """Each distinct match-label set with how many machines carry it."""
        counts: dict[Labels, int] = {}
        for groups in self._by_state.values():
            for shape, b in groups.items():
                lab = shape.match_labels
                counts[lab] = counts.get(lab, 0) + len(b)
        return list(counts.items())

    def clusters(self) -> list[str]:
        return sorted(self._by_cluster)

    def counts(self) -> dict[MachineState, int]:
        """Machines per state (every real state present, zeros included)."""
        return {s: self.count(s) for s in ALL_STATES}

    def count(self, state: MachineState) -> int:
        return sum(len(g) for g in self._by_state[state].values())

    def count_by_cluster_state(self) -> dict[tuple[str, MachineState], int]:
        out: dict[tuple[str, MachineState], int] = {}
        for cid, c in self._by_cluster.items():
            for m in c.values():
                k = (cid, m.state)
                out[k] = out.get(k, 0) + 1
        return out

    def copy(self) -> Inventory:
        """An independent inventory holding the same (immutable) records: a cheap per-cycle snapshot."""
        inv = Inventory()
        inv._machines = dict(self._machines)
        inv._by_state = {s: {lab: g.clone() for lab, g in d.items()} for s, d in self._by_state.items()}
        inv._by_cluster = {c: dict(d) for c, d in self._by_cluster.items()}
        inv._generation = self._generation
        return inv
