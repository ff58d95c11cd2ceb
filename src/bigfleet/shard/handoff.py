"""The shard side of cluster handoff and inventory rebalancing (coordinator instructions).

Ownership rule (two shards may share one provider, which lists every machine to both):

* Every shard keeps a :class:`~bigfleet.shard.ha.state.Ledger` in its replicated state: the machine
  ids it has *released* (handed to another shard) and the ids it has *adopted* (received from one),
  plus the clusters it has released and where they went.
* A released id is never ours again until an adopt names it (the ledger command commits before the
  ack leaves, so neither a restart nor a failover re-adopts it from the provider's ``List``).
* ``exclusive`` mode (default; the shard that owns the provider's pool): every listed machine is
  ours except released ones and ones whose ``shard_metadata`` owner key names another shard.
* ``shared`` mode (a shard added beside an existing one on the same provider): only adopted ids,
  and machines whose owner key names this shard, are ours. So an unmarked machine has exactly one
  claimant: the exclusive shard, unless it released it to someone.

Clusters follow machines: a released cluster's Session is refused (FAILED_PRECONDITION with the
``bigfleet-redirect`` trailer) until the coordinator asks this shard to adopt it again.

The handoff window: the old shard redirects the operator here as soon as it released, before the
coordinator has delivered ``AdoptCluster``. A Hello from a cluster this shard does not know is
therefore checked with the coordinator (``GetClusterStatus``, side-effect free): while a handoff of
it *to this shard* is in flight, the Hello waits up to ``adoption_hold`` seconds for the adoption and
is otherwise answered UNAVAILABLE with the ``bigfleet-retry-later`` trailer (the operator redials),
so this shard never provisions for a cluster whose machines are still on their way. Any doubt (no
coordinator, coordinator unreachable, cluster bound elsewhere) admits the Session as before.

The ownership rule and the victim/donor selection are pure; :class:`ShardHandoff` is the shell that
freezes the daemon, settles provider calls, commits the ledger change and acks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from bigfleet.coordclient.client import BaseInstructionHandler
from bigfleet.machine import Machine, MachineState
from bigfleet.needs import EMPTY_RESOURCES, Resources
from bigfleet.observability import get_logger
from bigfleet.shard.budgets import Candidate
from bigfleet.shard.ha.node import ShardLog
from bigfleet.shard.ha.state import Ledger, ReleasedCluster
from bigfleet.shard.provider_client import ProviderError
from bigfleet.v1alpha1 import capacity_pb2, coordinator_pb2, provider_pb2
from bigfleet.wire.needs import requirement_from_proto

if TYPE_CHECKING:
    from bigfleet.shard.daemon import ShardDaemon

log = get_logger("bigfleet.shard.handoff")


class CoordinatorCalls(Protocol):
    """The part of the coordinator client the shard uses outside its heartbeat loop."""

    async def call(self, method: str, request: Any, timeout: float | None = None) -> Any: ...

OWNER_KEY = "bigfleet.lucy.sh/owner-shard"
REDIRECT_METADATA_KEY = "bigfleet-redirect"
LEDGER_FILE = "ownership.json"  # before the ledger was replicated: imported once, then ignored
EXCLUSIVE, SHARED = "exclusive", "shared"


# --------------------------------------------------------------------------- pure bookkeeping
def owns(ledger: Ledger, shard_id: str, mode: str, pb: provider_pb2.Machine) -> bool:
    """The ownership rule for a provider record (see the module docstring)."""
    if pb.id in ledger.released:
        return False
    if pb.id in ledger.adopted:
        return True
    if not pb.cluster:  # the provider clears shard_metadata with the binding: no owner mark to read
        return mode == EXCLUSIVE
    owner = pb.shard_metadata.get(OWNER_KEY, "")
    if owner:
        return owner == shard_id
    return mode == EXCLUSIVE


def load_legacy_ledger(path: Path) -> Ledger | None:
    """A ledger file written before the ledger moved into the replicated state (None: no file)."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    led = Ledger(released={str(k): str(v) for k, v in dict(data.get("released", {})).items()},
                 adopted={str(x) for x in data.get("adopted", [])})
    for cid, rc in dict(data.get("released_clusters", {})).items():
        led.released_clusters[str(cid)] = ReleasedCluster(str(rc.get("to", "")), str(rc.get("address", "")),
                                                          tuple(str(m) for m in rc.get("machines", [])))
    return led


def _serves(reqs: Sequence[capacity_pb2.NodeSelectorRequirement], unit: Resources) -> Callable[[Machine], bool]:
    """Whether a machine can serve the need: it matches the requirements (instance type and zone
    included) and its allocatable holds at least one min unit."""
    parsed = [requirement_from_proto(r, "requirements") for r in reqs]
    return lambda m: m.matches(parsed) and m.effective_allocatable.covers(unit)


def _resources(pb: provider_pb2.Resources, field: str) -> Resources:
    return Resources.parse(dict(pb.resources), field) if pb.resources else Resources()


def _credit(m: Machine, unit: Resources) -> Resources:
    """What ``m`` serves of the need: its allocatable, in whole min units when the need has one."""
    alloc = m.effective_allocatable
    if not unit:
        return alloc
    rest = Resources((n, v) for n, v in alloc.items() if n not in unit)
    return unit.scale(alloc.times_fits(unit)) + rest


def _cover(candidates: Iterable[Machine], deficit: Resources, unit: Resources, limit: int) -> list[str]:
    """Take candidates in order until what they serve covers ``deficit`` (one machine when it is empty)."""
    out: list[str] = []
    total = Resources()
    for m in candidates:
        if len(out) >= limit:
            break
        out.append(m.id)
        total = total + _credit(m, unit)
        if not deficit.items() or total.covers(deficit):
            break
    return out


def pick_donations(machines: Iterable[Machine], busy: frozenset[str] | set[str],
                   reqs: Sequence[capacity_pb2.NodeSelectorRequirement], deficit: Resources,
                   min_unit: Resources = EMPTY_RESOURCES, limit: int = 256) -> list[str]:
    """Donor side of a tier-1 transfer: idle machines first, then speculative slots, that can serve
    the need (:func:`_serves`), cheapest first, until the deficit is covered."""
    ok = _serves(reqs, min_unit)
    free = [m for m in machines if m.id not in busy and m.state in (MachineState.IDLE, MachineState.SPECULATIVE) and ok(m)]
    free.sort(key=lambda m: (m.state is not MachineState.IDLE, m.shape.price_per_hour, m.id))
    return _cover(free, deficit, min_unit, limit)


def victim_score(m: Machine) -> tuple[float, int, str]:
    """Lower is drained first: what the running work loses if stopped, then its priority."""
    a = m.assignment
    return (a.reclamation_penalty_dollars + a.interruption_penalty_dollars, a.priority, m.id)


def pick_drain_victims(machines: Iterable[Machine], busy: frozenset[str] | set[str], preemptor_priority: int,
                       reqs: Sequence[capacity_pb2.NodeSelectorRequirement], deficit: Resources,
                       min_unit: Resources = EMPTY_RESOURCES, limit: int = 64) -> list[str]:
    """Tier 2: machines of strictly lower priority that can serve the need (:func:`_serves`), lowest
    score first. None qualifies: nothing is drained.

    Machines already Draining come first: their cluster was told and the provider is at it, so taking
    them disrupts no one new. That is the drain a killed or deposed leader had started for this very
    instruction when the coordinator redelivers it; picking a fresh victim instead disrupted a second
    machine and let the engine configure the first one back once its drain ended. (Drains this
    process runs are in flight, hence ``busy``.)"""
    ok = _serves(reqs, min_unit)
    cands = [m for m in machines if m.id not in busy and m.state in (MachineState.CONFIGURED, MachineState.DRAINING)
             and m.assignment.priority < preemptor_priority and ok(m)]
    cands.sort(key=lambda m: (m.state is not MachineState.DRAINING, victim_score(m)))
    return _cover(cands, deficit, min_unit, limit)


# --------------------------------------------------------------------------- the shell
class ShardHandoff(BaseInstructionHandler):
    """The shard's :class:`~bigfleet.coordclient.client.InstructionHandler`.

    Every ledger change is a command on the shard's replicated state, committed (under this
    leader's epoch) before the instruction is acknowledged: a restart, a failover or a deposed
    leader can never re-read a released machine as ours."""

    def __init__(self, daemon: ShardDaemon, log: ShardLog, epoch: int, mode: str = EXCLUSIVE,
                 coordinator: CoordinatorCalls | None = None, settle_timeout: float = 60.0, drain_timeout: float = 900.0) -> None:
        super().__init__()
        self.daemon = daemon
        self.log = log
        self.epoch = epoch
        self.mode = mode
        self.shard_id = daemon.config.shard_id
        self.settle_timeout = settle_timeout
        self.drain_timeout = drain_timeout
        self.session_wait = 30.0  # a drain victim's operator reconnecting after a takeover (cross_shard_drain)
        self._lock = asyncio.Lock()
        # With a coordinator: the handoff-window hold asks it about unknown clusters.
        self.coordinator = coordinator
        self.adoption_hold = 2.0
        self.status_timeout = 2.0
        # After a failed status call, admit without asking for this long (a down coordinator must not
        # add its timeout to every Hello of a mass reconnect).
        self.status_backoff = 5.0
        self._status_skip_until = 0.0
        self._adopted_events: dict[str, asyncio.Event] = {}  # cluster -> set once adopt_cluster finished

    @property
    def ledger(self) -> Ledger:
        return self.log.ledger()

    def owns(self, pb: provider_pb2.Machine) -> bool:
        # Per provider when the shard draws from several (bigfleet.shard.providers: NAME=HOST:PORT@shared).
        return owns(self.log.ledger(), self.shard_id, self.daemon.provider.ownership_for(pb.id) or self.mode, pb)

    async def refusal(self, cluster_id: str) -> tuple[str, str] | None:
        """(reason, redirect address) when this shard must not serve ``cluster_id``."""
        rc = self.log.ledger().released_clusters.get(cluster_id)
        if rc is not None and cluster_id not in self.daemon.frozen_clusters and await self._bound_here_again(cluster_id, rc):
            rc = None
        if cluster_id in self.daemon.frozen_clusters or rc is not None:
            addr = (rc.address if rc is not None else "") or self.daemon.redirects.get(cluster_id, "")
            where = f"; now served at {addr}" if addr else "; look it up again"
            self.daemon.metrics.handoff_sessions_refused.inc()
            return f"cluster {cluster_id} was handed off to another shard{where}", addr
        return None

    async def _bound_here_again(self, cluster_id: str, rc: ReleasedCluster) -> bool:
        """A cluster released here whose recipient was later removed: the coordinator binds it anew,
        possibly here, with an epoch above the one released at. Only then is the release lifted
        (a replicated adopt of no machines), so an old coordinator snapshot naming this shard does
        not make two shards serve the cluster."""
        if self.coordinator is None or rc.binding_epoch <= 0:
            return False
        st = await self._status(cluster_id)
        if (st is None or not st.bound or st.shard_id != self.shard_id or st.handoff_phase
                or st.binding_epoch <= rc.binding_epoch):
            return False
        async with self._lock:
            if self.log.ledger().released_clusters.get(cluster_id) is not rc:
                return self.log.ledger().released_clusters.get(cluster_id) is None  # lifted meanwhile?
            # The machines released with it that still serve it come back (the removed shard is gone
            # for good: the runbook removes only such a shard); ones it made later stay unowned.
            back = [mid for mid in rc.machines if await self._bound_to(mid, cluster_id)]
            try:
                got = await self._adopt(back, cluster_id)
            except RuntimeError:
                return False  # no longer leading: refused as before, the new leader decides
            self.daemon.redirects.pop(cluster_id, None)
            self.daemon.trigger()
        self._count("adopted", "cluster", len(got))
        log.info("cluster bound here again after its recipient was removed; serving it", cluster=cluster_id,
                 released_to=rc.to_shard, released_epoch=rc.binding_epoch, epoch=st.binding_epoch,
                 machines_back=len(got), released=len(rc.machines))
        return True

    async def _bound_to(self, machine_id: str, cluster_id: str) -> bool:
        try:
            return (await self.daemon.provider.get(machine_id)).cluster == cluster_id
        except ProviderError:
            return False

    async def _status(self, cluster_id: str) -> coordinator_pb2.GetClusterStatusResponse | None:
        """The coordinator's view of a cluster; None when it does not answer (then not asked again
        for ``status_backoff``: a down coordinator must not slow every Hello)."""
        loop = asyncio.get_running_loop()
        if self.coordinator is None or loop.time() < self._status_skip_until:
            return None
        try:
            st: coordinator_pb2.GetClusterStatusResponse = await self.coordinator.call(
                "GetClusterStatus", coordinator_pb2.GetClusterStatusRequest(cluster_id=cluster_id),
                timeout=self.status_timeout)
        except Exception as exc:  # fail open: the coordinator must never gate serving
            self._status_skip_until = loop.time() + self.status_backoff
            log.info("cluster status unknown; not asking the coordinator for a while", cluster=cluster_id,
                     error=str(exc)[:200], seconds=self.status_backoff)
            return None
        return st

    def _known(self, cluster_id: str) -> bool:
        """Clusters this shard already serves need no coordinator round trip."""
        ev = self._adopted_events.get(cluster_id)
        if ev is not None and ev.is_set():
            return True
        d = self.daemon
        return d.sessions.get(cluster_id) is not None or bool(d.view.bound_to(cluster_id))

    async def hold(self, cluster_id: str) -> str | None:
        """None to admit the Session; else why it must come back later (a handoff to us not adopted yet)."""
        if self.coordinator is None or self._known(cluster_id):
            return None
        st = await self._status(cluster_id)
        if st is None or st.handoff_to_shard_id != self.shard_id or not st.handoff_phase:
            return None
        ev = self._adopted_events.setdefault(cluster_id, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), self.adoption_hold)
            return None
        except TimeoutError:
            self.daemon.metrics.handoff_sessions_held.inc()
            log.info("session held back: cluster still being handed to this shard", cluster=cluster_id,
                     phase=st.handoff_phase, frm=st.shard_id)
            return (f"cluster {cluster_id} is being handed to this shard ({st.handoff_phase}); "
                    "retry shortly")

    def _count(self, direction: str, kind: str, n: int) -> None:
        if n:
            self.daemon.metrics.handoff_machines.labels(direction, kind).inc(n)

    async def _settle(self, ids: set[str]) -> None:
        """Wait for provider calls in flight on ``ids`` to finish (each ends stable or FAILED)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle_timeout
        while any(i in self.daemon.view.inflight for i in ids):
            if loop.time() > deadline:
                busy = sorted(i for i in ids if i in self.daemon.view.inflight)[:5]
                raise TimeoutError(f"provider calls still in flight on {busy}")
            await asyncio.sleep(0.05)

    def _forget(self, ids: Iterable[str]) -> None:
        self.daemon.forget_machines(ids)

    @staticmethod
    def _committed(res: tuple[str, ...] | None, what: str) -> tuple[str, ...]:
        if res is None:
            raise RuntimeError(f"{what}: refused by the replicated state (this replica no longer leads)")
        return res

    # -- cluster handoff ---------------------------------------------------------------------
    async def release_cluster(self, msg: coordinator_pb2.ReleaseCluster) -> list[str]:
        cid = msg.cluster_id
        if not cid:
            raise ValueError("release_cluster: empty cluster_id")
        async with self._lock:
            prev = self.log.ledger().released_clusters.get(cid)
            if prev is not None:
                return list(prev.machines)
            d = self.daemon
            # Right after a restart the view is empty until the first List: releasing then would hand
            # over nothing and strand the cluster's machines here.
            await asyncio.wait_for(d.reconciled.wait(), self.settle_timeout)
            d.frozen_clusters.add(cid)  # from here no cycle decides for it, no action reaches its machines
            d.redirects[cid] = msg.to_shard_address
            ids = {pb.id for pb in d.view.bound_to(cid)}
            d.frozen_machines.update(ids)
            addr = msg.to_shard_address
            reason = f"cluster {cid} was handed off to another shard" + (f"; now served at {addr}" if addr else "")
            s = d.sessions.get(cid)
            if s is not None:
                s.close_metadata = ((REDIRECT_METADATA_KEY, addr),) if addr else ()
                s.close(grpc.StatusCode.FAILED_PRECONDITION, reason)
            try:
                await self._settle(ids)
                ids |= {pb.id for pb in d.view.bound_to(cid)}  # anything a racing cycle bound meanwhile
                await self._settle(ids)
                released = self._committed(
                    await self.log.release_cluster(cid, tuple(ids), msg.to_shard_id, msg.to_shard_address,
                                                   self.epoch, msg.binding_epoch), "release_cluster")
            except BaseException:
                # Not released (the ack says FAILED; the coordinator aborts and the binding stays
                # here): serve the cluster again when its operator reconnects.
                d.frozen_clusters.discard(cid)
                d.frozen_machines.difference_update(ids)
                d.redirects.pop(cid, None)
                raise
            self._forget(released)
            self._adopted_events.pop(cid, None)  # adopting it back later must wait for that adoption
            d.forget_cluster(cid)
            d.frozen_clusters.discard(cid)  # the ledger refuses it from now on
            d.trigger()
            self._count("released", "cluster", len(released))
            log.info("cluster released", cluster=cid, to=msg.to_shard_id, machines=len(released),
                     handoff=msg.handoff_id)
            return list(released)

    async def _adopt(self, ids: Sequence[str], cluster_id: str = "") -> list[str]:
        if not await self.log.adopt(tuple(ids), cluster_id, self.epoch):
            raise RuntimeError("adopt: refused by the replicated state (this replica no longer leads)")
        got: list[str] = []
        for mid in ids:
            try:
                pb = await self.daemon.provider.get(mid)
            except ProviderError as exc:
                if exc.code == grpc.StatusCode.NOT_FOUND:
                    log.warning("adopted machine unknown to the provider", machine=mid)
                    continue
                raise
            self.daemon.view.observe(pb)
            got.append(mid)
        return got

    async def adopt_cluster(self, msg: coordinator_pb2.AdoptCluster) -> None:
        if not msg.cluster_id:
            raise ValueError("adopt_cluster: empty cluster_id")
        async with self._lock:
            got = await self._adopt(list(msg.machine_ids), msg.cluster_id)
            self.daemon.frozen_clusters.discard(msg.cluster_id)
            self.daemon.redirects.pop(msg.cluster_id, None)
            self._adopted_events.setdefault(msg.cluster_id, asyncio.Event()).set()  # held Hellos go ahead
            self.daemon.trigger()
            self._count("adopted", "cluster", len(got))
            log.info("cluster adopted", cluster=msg.cluster_id, machines=len(got), of=len(msg.machine_ids),
                     handoff=msg.handoff_id)

    # -- inventory transfers -----------------------------------------------------------------
    async def release_inventory(self, msg: coordinator_pb2.TransferOwnership) -> list[str]:
        async with self._lock:
            key = f"transfer:{msg.transfer_id}"
            again = self.log.ledger().released_for(key) if msg.transfer_id else []
            if again:
                return again
            d = self.daemon
            await asyncio.wait_for(d.reconciled.wait(), self.settle_timeout)
            ids = pick_donations(d.view.machines(), set(d.view.inflight) | d.frozen_machines, msg.requirements,
                                 _resources(msg.deficit, "deficit"), _resources(msg.min_unit, "min_unit"))
            if ids:
                ids = list(self._committed(await self.log.release_machines(tuple(ids), key, self.epoch),
                                           "release_inventory"))
            self._forget(ids)
            d.trigger()
            self._count("released", "inventory", len(ids))
            log.info("inventory released", transfer=msg.transfer_id, to=msg.to_shard_id, machines=len(ids))
            return ids

    async def adopt_inventory(self, msg: coordinator_pb2.TransferOwnership) -> None:
        async with self._lock:
            got = await self._adopt(list(msg.machine_ids))
            self.daemon.trigger()
            self._count("adopted", "inventory", len(got))
            log.info("inventory adopted", transfer=msg.transfer_id, frm=msg.from_shard_id, machines=len(got))

    async def cross_shard_drain(self, msg: coordinator_pb2.CrossShardDrain) -> list[str]:
        key = f"transfer:{msg.transfer_id}"
        again = self.log.ledger().released_for(key) if msg.transfer_id else []
        if again:
            return again
        d = self.daemon
        if d.paused or d.dry_run:
            # The kill switch covers what the coordinator asks too: a paused shard makes no provider
            # call and drains nothing. The transfer fails and the coordinator tries again later.
            raise RuntimeError("cross-shard drain refused: actuation is " + ("paused" if d.paused else "dry-run")
                               + " on this shard")
        await asyncio.wait_for(d.reconciled.wait(), self.settle_timeout)
        if msg.machine_ids:
            ids = [m for m in msg.machine_ids if d.view.get(m) is not None]
        else:
            ids = pick_drain_victims(d.view.machines(), set(d.view.inflight) | d.frozen_machines,
                                     msg.preemptor_priority, msg.requirements, _resources(msg.deficit, "deficit"),
                                     _resources(msg.min_unit, "min_unit"))
        # A cross-shard preemption is a disruption like any other: it fits the victims' budgets or waits.
        # A victim already Draining was admitted when its drain started.
        fresh = {mid: m.cluster for mid in ids if (m := d.view.machine(mid)) is not None
                 and m.state is MachineState.CONFIGURED}
        allowed = await d.budgets.admit([Candidate(cluster, mid, "preempt") for mid, cluster in fresh.items()])
        ids = [mid for mid in ids if mid in allowed or mid not in fresh]
        victims = list(ids)
        d.frozen_machines.update(victims)  # the engine neither re-uses nor re-drains them meanwhile
        try:
            # The executor drops a drain whose cluster cannot be told (no Session), and a drain that
            # frees nothing ends the transfer empty (the coordinator then asks this shard no more for
            # a while). Right after a takeover or restart, when the coordinator redelivers its drain at
            # once, the victims' operators have not reconnected yet: give them `session_wait`.
            await d.sessions.connected({fresh[mid] for mid in ids if mid in fresh}, self.session_wait)
            for mid in ids:
                m = d.view.machine(mid)
                if m is not None and m.state is MachineState.CONFIGURED:
                    # The executor's preempt path: the owning cluster's operator gets the
                    # ReclaimInstruction before the provider is asked to drain.
                    d.executor.submit_drain(mid, 30, msg.preemptor_priority, "preempt")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.drain_timeout
            while True:
                # Settled: nothing in flight any more. A drain the executor dropped (the operator
                # never got or acked its ReclaimInstruction) leaves the victim Configured here.
                if all(mid not in d.view.inflight for mid in ids) and \
                        all(m is None or m.state is not MachineState.DRAINING for m in map(d.view.machine, ids)):
                    break
                if loop.time() > deadline:
                    raise TimeoutError("cross-shard drain: victims did not drain in time")
                await asyncio.sleep(0.1)
            # Only drained (Idle) machines travel; a victim whose drain failed stays here.
            ids = [mid for mid in ids if (m := d.view.machine(mid)) is not None and m.state is MachineState.IDLE]
            async with self._lock:
                if ids:
                    ids = list(self._committed(await self.log.release_machines(tuple(ids), key, self.epoch),
                                               "cross_shard_drain"))
                self._forget(ids)
        finally:
            d.frozen_machines.difference_update(victims)
            d.trigger()
        self._count("released", "drain", len(ids))
        log.info("cross-shard drain released", transfer=msg.transfer_id, to=msg.to_shard_id, machines=len(ids))
        return ids
