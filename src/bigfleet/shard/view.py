"""The shard's view of its machines: provider records plus the shard's own overlays.

The provider is the source of truth, but between a lifecycle call and the
provider's record catching up the shard must already show the machine as
taken (CREATING/CONFIGURING/DRAINING/DELETING with its reservation) so the
next cycle neither picks it again nor forgets what it is for. Machines with
an action in flight are owned by the executor: reconcile records what the
provider says but does not overwrite them. FAILED set by the shard is
sticky (terminal; cleaned up out of band).

Every change of a machine bound (or being bound) to a cluster produces a
NodeStateUpdate for that cluster; the binding held *before* the change routes
it, so the final Draining→Idle update still reaches the cluster it left.

Provider records are kept serialized. A parsed ``provider_pb2.Machine`` costs
~2.5–3 KB of memory in CPython's upb runtime against ~350 B as bytes, and the
shard reads the full proto only on its cold paths (a Hello's replay, the
executor claiming a machine, admin reads); the engine reads the validated
``Machine`` records. At 500 000 machines that is the difference between ~1.4 GB
and ~0.2 GB.
"""

from __future__ import annotations

import builtins
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

from bigfleet.machine import Assignment, Machine, ValidationError
from bigfleet.machine import rejection_reason as _core_rejection_reason
from bigfleet.needs.penalty import bucket_from_dollars
from bigfleet.observability import get_logger
from bigfleet.v1alpha1 import provider_pb2, shard_pb2
from bigfleet.wire.machine import machine_from_proto

log = get_logger("bigfleet.shard.view")

S = provider_pb2.MachineState
#: states in which a machine belongs to one cluster (changing cluster means passing Idle first)
BOUND_STATES = frozenset({S.MACHINE_STATE_CONFIGURING, S.MACHINE_STATE_CONFIGURED, S.MACHINE_STATE_DRAINING})

HOSTNAME_LABEL = "kubernetes.io/hostname"
NODE_NAME_METADATA = "bigfleet.lucy.sh/node-name"


def node_name(pb: provider_pb2.Machine) -> str:
    """Kubernetes node name of a machine: provider hostname label, then recorded name, then the id (decision 7)."""
    return pb.labels.get(HOSTNAME_LABEL) or pb.shard_metadata.get(NODE_NAME_METADATA) or pb.id


def rejection_reason(exc: ValidationError) -> str:
    return _core_rejection_reason(exc)


def node_state_update(pb: provider_pb2.Machine, cluster_id: str) -> shard_pb2.ShardMessage:
    labels = dict(pb.labels)
    if pb.instance_type:
        labels.setdefault("node.kubernetes.io/instance-type", pb.instance_type)
    if pb.zone:
        labels.setdefault("topology.kubernetes.io/zone", pb.zone)
    res = pb.allocatable if pb.allocatable.resources else pb.resources
    return shard_pb2.ShardMessage(
        node_state_update=shard_pb2.NodeStateUpdate(
            supersedes_key=f"node:{pb.id}",
            machine_id=pb.id,
            cluster_id=cluster_id,
            state=pb.state,
            node_name=node_name(pb),
            provider_id=pb.host.ref,
            last_error=pb.last_error,
            labels=labels,
            resources=provider_pb2.Resources(resources=dict(res.resources)),
            # What the provider declares the node registers with (provider.proto Machine.taints).
            taints=[shard_pb2.Taint(key=t.key, value=t.value, effect=t.effect) for t in pb.taints],
        )
    )


NodeSink = Callable[[str, shard_pb2.ShardMessage], None]

#: (state, capacity type, interruption penalty bucket label): the inventory gauge's labels
InventoryKey = tuple[int, int, str]
_PENALTY_LABELS: dict[float, str] = {}


def penalty_label(a: Assignment) -> str:
    """The interruption penalty bucket a machine's need stamped on it, as a metric label (the
    bucket's upper bound in dollars, "pinned"), or "none" for a machine assigned to no need."""
    if a.is_empty:
        return "none"
    dollars = a.interruption_penalty_dollars
    label = _PENALTY_LABELS.get(dollars)
    if label is None:
        try:
            label = bucket_from_dollars(dollars).label
        except ValueError:  # (NaN or negative: never stamped by the shard)
            label = "unspecified"
        if len(_PENALTY_LABELS) < 4096:
            _PENALTY_LABELS[dollars] = label
    return label


def inventory_key(m: Machine) -> InventoryKey:
    return (int(m.state), int(m.shape.capacity_type), penalty_label(m.assignment))


class MachineView:
    def __init__(self, on_node_update: NodeSink | None = None, on_reject: Callable[[str], None] | None = None,
                 wall_ns: Callable[[], int] = time.time_ns) -> None:
        self._wall_ns = wall_ns  # injectable: the simulator runs on a virtual clock
        # What the engine reads (it only needs ``machines()``). Not a core ``Inventory``: a machine
        # being created for a need carries the cluster it is for, which the engine credits but the
        # record invariant (no cluster before Configure) would refuse.
        self._machines: dict[str, Machine] = {}
        self._pb: dict[str, bytes] = {}  # serialized (deterministic) provider records, see module doc
        # The provider's newest record of a machine the view does not show as such: one the
        # executor owns (in flight), one failed locally, or one whose record was rejected. For any
        # other machine the view's own record is the provider's latest.
        self.provider_latest: dict[str, provider_pb2.Machine] = {}
        self.inflight: dict[str, str] = {}
        self.failed_local: set[str] = set()
        #: machines failed here only for a while (a Create refused for capacity): id -> when (the
        #: reconcile's clock) the provider's record is shown again and the engine may pick it anew
        self.cooling: dict[str, float] = {}
        # A machine being created for a cluster carries no cluster yet (the record forbids it
        # before Configure); this routes its NodeStateUpdates to the cluster it is for.
        self.reserved_for: dict[str, str] = {}
        self._on_node_update = on_node_update
        self._on_reject = on_reject
        self.version = 0
        # cluster -> ids of machines whose record names it (insertion-ordered), so a Session's
        # Hello replays its nodes without scanning the whole inventory (1 000s of Hellos x 100k machines).
        self._by_cluster: dict[str, dict[str, None]] = {}
        # Change tracking for the engine worker's mirror (bigfleet.shard.engineproc): every id whose
        # engine record was installed or removed since the consumer last took the set.
        self.dirty: set[str] = set()
        # Kept up to date on every write so per-cycle gauges and the orphan-Create check cost
        # O(1) / O(creating) instead of a walk over the whole fleet.
        self._state_counts: Counter[int] = Counter()
        self.type_counts: Counter[str] = Counter()
        self.zone_counts: Counter[str] = Counter()
        self.creating: dict[str, None] = {}
        #: machines per `InventoryKey` (a key whose count fell to 0 stays, so its gauge reads 0)
        self.inventory_counts: Counter[InventoryKey] = Counter()

    def __len__(self) -> int:
        return len(self._pb)

    def machines(self) -> Iterable[Machine]:
        """The engine's input: one validated record per machine, reservations applied."""
        return self._machines.values()

    def machine(self, machine_id: str) -> Machine | None:
        return self._machines.get(machine_id)

    def get(self, machine_id: str) -> provider_pb2.Machine | None:
        """The record as shown (a fresh message: callers may modify it)."""
        raw = self._pb.get(machine_id)
        return provider_pb2.Machine.FromString(raw) if raw is not None else None

    def shows(self, pb: provider_pb2.Machine) -> bool:
        """True if the view's record of ``pb.id`` is exactly ``pb``."""
        return self._pb.get(pb.id) == pb.SerializeToString(deterministic=True)

    def all(self) -> Iterable[provider_pb2.Machine]:
        """Every record, parsed one at a time (a cold path: admin reads, tests)."""
        for raw in list(self._pb.values()):
            yield provider_pb2.Machine.FromString(raw)

    def ids(self) -> list[str]:
        return list(self._pb)

    def set(self, pb: provider_pb2.Machine, *, force: bool = False) -> bool:
        """Install ``pb`` as the shard's record; False if validation rejected it (the old one stays)."""
        if pb.id in self.failed_local and not force:
            return True
        raw = pb.SerializeToString(deterministic=True)
        old_raw = self._pb.get(pb.id)
        if old_raw is not None and old_raw == raw:
            return True
        now = self._wall_ns()
        try:
            m = machine_from_proto(pb, now_unix_nanos=now)
        except ValidationError as exc:
            reason = rejection_reason(exc)
            log.warning("machine record rejected", machine=pb.id, reason=reason, error=str(exc))
            if self._on_reject:
                self._on_reject(reason)
            return False
        reserved = self.reserved_for.get(pb.id)
        if reserved and not m.cluster and pb.state == S.MACHINE_STATE_CREATING:
            m = m.replace(cluster=reserved)
        prev = self._machines.get(pb.id)
        if prev is not None and prev.state is m.state:
            m = m.replace(state_since_unix_nanos=prev.state_since_unix_nanos)
        old = provider_pb2.Machine.FromString(old_raw) if old_raw is not None else None
        self._pb[pb.id] = raw
        self._machines[pb.id] = m
        if prev is not None:
            self.inventory_counts[inventory_key(prev)] -= 1
        self.inventory_counts[inventory_key(m)] += 1
        self.version += 1
        self.dirty.add(pb.id)
        self._count(old, pb)
        self._index(pb.id, old.cluster if old is not None else "", pb.cluster)
        self._emit(old, pb)
        return True

    def _index(self, machine_id: str, old_cluster: str, new_cluster: str) -> None:
        if old_cluster == new_cluster:
            return
        if old_cluster:
            ids = self._by_cluster.get(old_cluster)
            if ids is not None:
                ids.pop(machine_id, None)
                if not ids:
                    del self._by_cluster[old_cluster]
        if new_cluster:
            self._by_cluster.setdefault(new_cluster, {})[machine_id] = None

    def observe(self, pb: provider_pb2.Machine) -> bool:
        """A record from the provider (List/Get/ack); applied unless the executor owns the machine.
        A record that no sequence of legal transitions explains is quarantined: the machine is
        failed here with the reason, counted and logged, instead of being trusted."""
        if pb.id in self.inflight or pb.id in self.failed_local:
            self.provider_latest[pb.id] = pb
            return True
        illegal = self.illegal_change(pb)
        if illegal:
            log.warning("provider reported an illegal transition; machine quarantined", machine=pb.id, why=illegal)
            if self._on_reject:
                self._on_reject("illegal_transition")
            self.provider_latest[pb.id] = pb
            self.mark_failed(pb.id, f"quarantined: provider reported {illegal}")
            return False
        if self.set(pb):
            self.provider_latest.pop(pb.id, None)  # the view's record is the latest now
            return True
        self.provider_latest[pb.id] = pb
        return False

    def illegal_change(self, pb: provider_pb2.Machine) -> str:
        """Why the provider's new record cannot follow the one held ("" when it can). Lists skip
        intermediate states, so only changes no path explains count: leaving FAILED (terminal;
        a slot recycled out of band comes back Speculative), or a bound machine moving to another
        cluster without passing Idle."""
        old_raw = self._pb.get(pb.id)
        if old_raw is None:
            return ""
        old = provider_pb2.Machine.FromString(old_raw)
        if old.state == S.MACHINE_STATE_FAILED and pb.state not in (S.MACHINE_STATE_FAILED, S.MACHINE_STATE_SPECULATIVE):
            return f"FAILED -> {S.Name(pb.state)}"
        if old.cluster and pb.cluster and old.cluster != pb.cluster and old.state in BOUND_STATES \
                and pb.state in BOUND_STATES:
            return f"{S.Name(old.state)} for {old.cluster!r} -> {S.Name(pb.state)} for {pb.cluster!r} without Idle"
        return ""

    def forget(self, machine_id: str) -> None:
        if (old_raw := self._pb.pop(machine_id, None)) is not None:
            old = provider_pb2.Machine.FromString(old_raw)
            self._index(machine_id, old.cluster, "")
            if (gone := self._machines.pop(machine_id, None)) is not None:
                self.inventory_counts[inventory_key(gone)] -= 1
            self.version += 1
            self.dirty.add(machine_id)
            self._count(old, None)
        self.provider_latest.pop(machine_id, None)

    def mark_failed(self, machine_id: str, error: str) -> None:
        self.cooling.pop(machine_id, None)  # (failed for good; `cool_down` sets its own after this)
        pb = self.get(machine_id)  # (a fresh message)
        if pb is None:
            latest = self.provider_latest.get(machine_id)
            if latest is None:
                return
            pb = provider_pb2.Machine()
            pb.CopyFrom(latest)
        pb.state = S.MACHINE_STATE_FAILED
        pb.last_error = error
        self.failed_local.discard(machine_id)
        if self.set(pb, force=True):
            self.failed_local.add(machine_id)

    def cool_down(self, machine_id: str, error: str, until: float) -> None:
        """Shown FAILED with `error` until `until`, then as the provider has it: the provider refused
        the machine for now (no capacity), not for good, and picking it again at once would only
        repeat the refusal every cycle."""
        self.mark_failed(machine_id, error)
        if machine_id in self.failed_local:
            self.cooling[machine_id] = until

    def end_cooldowns(self, now: float) -> list[str]:
        """Show the provider's newest record again for every cool-down that is over (the ids)."""
        done = [mid for mid, until in self.cooling.items() if until <= now]
        for mid in done:
            del self.cooling[mid]
            if mid not in self.failed_local:
                continue  # failed for good meanwhile (or forgotten)
            self.failed_local.discard(mid)
            latest = self.provider_latest.pop(mid, None)
            if latest is None or not self.set(latest, force=True):
                self.forget(mid)  # the next List shows it as the provider has it
        return done

    def _count(self, old: provider_pb2.Machine | None, new: provider_pb2.Machine | None) -> None:
        if old is not None:
            self._state_counts[int(old.state)] -= 1
            if old.state == S.MACHINE_STATE_CREATING:
                self.creating.pop(old.id, None)
            if old.instance_type:
                self.type_counts[old.instance_type] -= 1
            if old.zone:
                self.zone_counts[old.zone] -= 1
        if new is not None:
            self._state_counts[int(new.state)] += 1
            if new.state == S.MACHINE_STATE_CREATING:
                self.creating[new.id] = None
            if new.instance_type:
                self.type_counts[new.instance_type] += 1
            if new.zone:
                self.zone_counts[new.zone] += 1

    def take_dirty(self) -> builtins.set[str]:
        """The ids changed since the last call (and start a new set)."""
        d, self.dirty = self.dirty, set()
        return d

    def counts(self) -> Counter[int]:
        """Machines per provider state (maintained on every write)."""
        return +self._state_counts

    def census(self, cluster_id: str = "") -> tuple[dict[int, int], dict[str, int], int, int]:
        """(machines per provider state, bound machines per cluster, total, in flight), over every
        machine or those whose record names ``cluster_id``. From the kept counts, the cluster index
        and the validated records: no provider record is parsed."""
        machines, busy = self._machines, self.inflight
        bound: dict[str, int] = {}
        if not cluster_id:
            per_state = {int(st): n for st, n in self._state_counts.items() if n > 0}
            for cid, ids in self._by_cluster.items():
                n = sum(1 for mid in ids if int(machines[mid].state) in BOUND_STATES)
                if n:
                    bound[cid] = n
            return per_state, bound, len(self._pb), sum(1 for mid in busy if mid in self._pb)
        per_state = {}
        ids = self._by_cluster.get(cluster_id, {})
        for mid in ids:
            st = int(machines[mid].state)
            per_state[st] = per_state.get(st, 0) + 1
            if st in BOUND_STATES:
                bound[cluster_id] = bound.get(cluster_id, 0) + 1
        return per_state, bound, len(ids), sum(1 for mid in ids if mid in busy)

    def route(self, pb: provider_pb2.Machine) -> str:
        return pb.cluster or self.reserved_for.get(pb.id, "")

    def cluster_ids(self, cluster_id: str) -> Mapping[str, None]:
        """The ids of the machines whose records name the cluster (the index Hello replays read; a
        live view, not a copy: do not keep it across awaits)."""
        return self._by_cluster.get(cluster_id, {})

    def bound_to(self, cluster_id: str) -> list[provider_pb2.Machine]:
        """Records routed to ``cluster_id``: those naming it, then those being created for it."""
        parse = provider_pb2.Machine.FromString
        out = [parse(self._pb[mid]) for mid in self._by_cluster.get(cluster_id, ())]
        for mid, cid in self.reserved_for.items():
            if cid == cluster_id and (raw := self._pb.get(mid)) is not None and not (pb := parse(raw)).cluster:
                out.append(pb)
        return out

    def _emit(self, old: provider_pb2.Machine | None, new: provider_pb2.Machine) -> None:
        if self._on_node_update is None:
            return
        if old is not None and old.state == new.state and old.cluster == new.cluster and old.last_error == new.last_error \
                and node_name(old) == node_name(new):
            return
        target = self.route(new) or (old.cluster if old is not None else "")
        if target:
            self._on_node_update(target, node_state_update(new, target))
