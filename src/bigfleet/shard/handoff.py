"""The shard side of cluster handoff and inventory rebalancing (coordinator instructions).

Ownership rule (two shards may share one provider, which lists every machine to both):

* Every shard persists an :class:`OwnershipLedger` in its data dir: the machine ids it has
  *released* (handed to another shard) and the ids it has *adopted* (received from one), plus the
  clusters it has released and where they went.
* A released id is never ours again until an adopt names it (the ledger is written before the
  ack leaves, so a restart never re-adopts it from the provider's ``List``).
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

The ledger and the victim/donor selection are pure; :class:`ShardHandoff` is the shell that
freezes the daemon, settles provider calls, persists and acks.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from bigfleet.coordclient.client import BaseInstructionHandler
from bigfleet.machine import Machine, MachineState
from bigfleet.needs import Resources
from bigfleet.needs.requirements import matches_all
from bigfleet.observability import get_logger
from bigfleet.shard.provider_client import ProviderError
from bigfleet.v1alpha1 import capacity_pb2, coordinator_pb2, provider_pb2
from bigfleet.wire.needs import requirement_from_proto

if TYPE_CHECKING:
    from bigfleet.shard.daemon import ShardDaemon

log = get_logger("bigfleet.shard.handoff")

OWNER_KEY = "bigfleet.lucy.sh/owner-shard"
REDIRECT_METADATA_KEY = "bigfleet-redirect"
LEDGER_FILE = "ownership.json"
EXCLUSIVE, SHARED = "exclusive", "shared"


# --------------------------------------------------------------------------- pure bookkeeping
@dataclass
class OwnershipLedger:
    """Which provider machines and clusters this shard may act on (persisted as JSON)."""

    shard_id: str
    mode: str = EXCLUSIVE
    released: dict[str, str] = field(default_factory=dict)  # machine id -> why (cluster / transfer id)
    adopted: set[str] = field(default_factory=set)
    released_clusters: dict[str, dict[str, Any]] = field(default_factory=dict)  # cluster -> {to, address, machines}

    def owns(self, pb: provider_pb2.Machine) -> bool:
        if pb.id in self.released:
            return False
        if pb.id in self.adopted:
            return True
        if not pb.cluster:  # the provider clears shard_metadata with the binding: no owner mark to read
            return self.mode == EXCLUSIVE
        owner = pb.shard_metadata.get(OWNER_KEY, "")
        if owner:
            return owner == self.shard_id
        return self.mode == EXCLUSIVE

    def cluster_released(self, cluster_id: str) -> bool:
        return cluster_id in self.released_clusters

    def redirect_for(self, cluster_id: str) -> str:
        return str(self.released_clusters.get(cluster_id, {}).get("address", ""))

    def release_cluster(self, cluster_id: str, machine_ids: Iterable[str], to_shard: str, address: str) -> list[str]:
        ids = sorted(set(machine_ids))
        self.released_clusters[cluster_id] = {"to": to_shard, "address": address, "machines": ids}
        self.release(ids, cluster_id)
        return ids

    def release(self, machine_ids: Iterable[str], why: str) -> None:
        for mid in machine_ids:
            self.released[mid] = why
            self.adopted.discard(mid)

    def adopt(self, machine_ids: Iterable[str], cluster_id: str = "") -> None:
        for mid in machine_ids:
            self.released.pop(mid, None)
            self.adopted.add(mid)
        if cluster_id:
            self.released_clusters.pop(cluster_id, None)

    def to_json(self) -> dict[str, Any]:
        return {
            "shard_id": self.shard_id,
            "released": self.released,
            "adopted": sorted(self.adopted),
            "released_clusters": self.released_clusters,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], shard_id: str, mode: str) -> OwnershipLedger:
        return cls(
            shard_id=shard_id,
            mode=mode,
            released={str(k): str(v) for k, v in dict(data.get("released", {})).items()},
            adopted={str(x) for x in data.get("adopted", [])},
            released_clusters={str(k): dict(v) for k, v in dict(data.get("released_clusters", {})).items()},
        )


def load_ledger(path: Path, shard_id: str, mode: str) -> OwnershipLedger:
    if not path.exists():
        return OwnershipLedger(shard_id, mode)
    return OwnershipLedger.from_json(json.loads(path.read_text()), shard_id, mode)


def save_ledger(path: Path, ledger: OwnershipLedger) -> None:
    """Atomic and durable: an ack that handed machines away must never outlive the record of it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(ledger.to_json(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _selector(reqs: Sequence[capacity_pb2.NodeSelectorRequirement]) -> Callable[[Machine], bool]:
    parsed = [requirement_from_proto(r, "requirements") for r in reqs]
    return lambda m: matches_all(parsed, m.labels)


def _deficit(pb: provider_pb2.Resources) -> Resources:
    return Resources.parse(dict(pb.resources), "deficit") if pb.resources else Resources()


def _cover(candidates: Iterable[Machine], deficit: Resources, limit: int) -> list[str]:
    """Take candidates in order until their resources cover ``deficit`` (one machine when it is empty)."""
    out: list[str] = []
    total = Resources()
    for m in candidates:
        if len(out) >= limit:
            break
        out.append(m.id)
        total = total + m.resources
        if not deficit.items() or total.covers(deficit):
            break
    return out


def pick_donations(machines: Iterable[Machine], busy: frozenset[str] | set[str],
                   reqs: Sequence[capacity_pb2.NodeSelectorRequirement], deficit: Resources,
                   limit: int = 256) -> list[str]:
    """Donor side of a tier-1 transfer: idle machines first, then speculative slots, matching the
    selector, cheapest first, until the deficit is covered."""
    ok = _selector(reqs)
    free = [m for m in machines if m.id not in busy and m.state in (MachineState.IDLE, MachineState.SPECULATIVE) and ok(m)]
    free.sort(key=lambda m: (m.state is not MachineState.IDLE, m.shape.price_per_hour, m.id))
    return _cover(free, deficit, limit)


def victim_score(m: Machine) -> tuple[float, int, str]:
    """Lower is drained first: what the running work loses if stopped, then its priority."""
    a = m.assignment
    return (a.reclamation_penalty_dollars + a.interruption_penalty_dollars, a.priority, m.id)


def pick_drain_victims(machines: Iterable[Machine], busy: frozenset[str] | set[str], preemptor_priority: int,
                       reqs: Sequence[capacity_pb2.NodeSelectorRequirement], deficit: Resources,
                       limit: int = 64) -> list[str]:
    """Tier 2: configured machines of strictly lower priority matching the selector, lowest score first."""
    ok = _selector(reqs)
    cands = [m for m in machines if m.id not in busy and m.state is MachineState.CONFIGURED
             and m.assignment.priority < preemptor_priority and ok(m)]
    cands.sort(key=victim_score)
    return _cover(cands, deficit, limit)


# --------------------------------------------------------------------------- the shell
class ShardHandoff(BaseInstructionHandler):
    """The shard's :class:`~bigfleet.coordclient.client.InstructionHandler`."""

    def __init__(self, daemon: ShardDaemon, data_dir: Path, mode: str = EXCLUSIVE,
                 settle_timeout: float = 60.0, drain_timeout: float = 900.0) -> None:
        super().__init__()
        self.daemon = daemon
        self.path = Path(data_dir) / LEDGER_FILE
        self.ledger = load_ledger(self.path, daemon.config.shard_id, mode)
        self.settle_timeout = settle_timeout
        self.drain_timeout = drain_timeout
        self._lock = asyncio.Lock()
        # Set by the shard's CLI when it runs with --coordinator: enables the handoff-window hold.
        self.coordinator: Any = None
        self.adoption_hold = 2.0
        self.status_timeout = 2.0
        # After a failed status call, admit without asking for this long (a down coordinator must not
        # add its timeout to every Hello of a mass reconnect).
        self.status_backoff = 5.0
        self._status_skip_until = 0.0
        self._adopted_events: dict[str, asyncio.Event] = {}  # cluster -> set once adopt_cluster finished
        # Hook the daemon: reconcile keeps only our machines; Sessions of released clusters are refused.
        daemon.owns = self.ledger.owns
        daemon.servicer.refuse_cluster = self.refusal
        daemon.servicer.hold_cluster = self.hold
        daemon.owner_id = daemon.config.shard_id
        # Bound machines carry their owner: a shard sharing the provider leaves them alone.
        if hasattr(daemon.provider, "extra_metadata"):
            daemon.provider.extra_metadata = {OWNER_KEY: daemon.config.shard_id}

    def _save(self) -> None:
        save_ledger(self.path, self.ledger)

    def refusal(self, cluster_id: str) -> tuple[str, str] | None:
        """(reason, redirect address) when this shard must not serve ``cluster_id``."""
        if cluster_id in self.daemon.frozen_clusters or self.ledger.cluster_released(cluster_id):
            addr = self.ledger.redirect_for(cluster_id) or self.daemon.redirects.get(cluster_id, "")
            where = f"; now served at {addr}" if addr else "; look it up again"
            self._count_refusal()
            return f"cluster {cluster_id} was handed off to another shard{where}", addr
        return None

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
        loop = asyncio.get_running_loop()
        if loop.time() < self._status_skip_until:
            return None
        try:
            st = await self.coordinator.call(
                "GetClusterStatus", coordinator_pb2.GetClusterStatusRequest(cluster_id=cluster_id),
                timeout=self.status_timeout)
        except Exception as exc:  # fail open: the coordinator must never gate serving
            self._status_skip_until = loop.time() + self.status_backoff
            log.info("cluster status unknown; admitting sessions without asking for a while", cluster=cluster_id,
                     error=str(exc)[:200], seconds=self.status_backoff)
            return None
        me = self.daemon.config.shard_id
        if st.handoff_to_shard_id != me or not st.handoff_phase:
            return None
        ev = self._adopted_events.setdefault(cluster_id, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), self.adoption_hold)
            return None
        except TimeoutError:
            m = getattr(self.daemon.metrics, "handoff_sessions_held", None)
            if m is not None:
                m.inc()
            log.info("session held back: cluster still being handed to this shard", cluster=cluster_id,
                     phase=st.handoff_phase, frm=st.shard_id)
            return (f"cluster {cluster_id} is being handed to this shard ({st.handoff_phase}); "
                    "retry shortly")

    def _count_refusal(self) -> None:
        m = getattr(self.daemon.metrics, "handoff_sessions_refused", None)
        if m is not None:
            m.inc()

    def _count(self, direction: str, kind: str, n: int) -> None:
        m = getattr(self.daemon.metrics, "handoff_machines", None)
        if m is not None and n:
            m.labels(direction, kind).inc(n)

    async def _settle(self, ids: set[str]) -> None:
        """Wait for provider calls in flight on ``ids`` to finish (each ends stable or FAILED)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle_timeout
        while any(i in self.daemon.view.inflight for i in ids):
            if loop.time() > deadline:
                raise TimeoutError(f"provider calls still in flight on {sorted(i for i in ids if i in self.daemon.view.inflight)[:5]}")
            await asyncio.sleep(0.05)

    def _forget(self, ids: Iterable[str]) -> None:
        v = self.daemon.view
        for mid in ids:
            v.forget(mid)
            v.reserved_for.pop(mid, None)
            v.failed_local.discard(mid)
        self.daemon.frozen_machines.difference_update(ids)

    # -- cluster handoff ---------------------------------------------------------------------
    async def release_cluster(self, msg: coordinator_pb2.ReleaseCluster) -> list[str]:
        cid = msg.cluster_id
        if not cid:
            raise ValueError("release_cluster: empty cluster_id")
        async with self._lock:
            prev = self.ledger.released_clusters.get(cid)
            if prev is not None:
                return list(prev.get("machines", []))
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
                released = self.ledger.release_cluster(cid, ids, msg.to_shard_id, msg.to_shard_address)
                self._save()
            except BaseException:
                # Not released (the ack says FAILED; the coordinator aborts and the binding stays
                # here): serve the cluster again when its operator reconnects.
                self.ledger.released_clusters.pop(cid, None)
                for mid in ids:
                    self.ledger.released.pop(mid, None)
                d.frozen_clusters.discard(cid)
                d.frozen_machines.difference_update(ids)
                d.redirects.pop(cid, None)
                raise
            self._forget(released)
            self._adopted_events.pop(cid, None)  # adopting it back later must wait for that adoption
            forget = getattr(d.store, "forget_cluster", None)
            if forget is not None:
                forget(cid)
            else:
                d.store.table.remove(cid)
            d._accepted_digest.pop(cid, None)  # a later identical roll-up (after an adopt back) must apply again
            d.frozen_clusters.discard(cid)  # the ledger refuses it from now on
            d.trigger()
            self._count("released", "cluster", len(released))
            log.info("cluster released", cluster=cid, to=msg.to_shard_id, machines=len(released),
                     handoff=msg.handoff_id)
            return released

    async def _adopt(self, ids: Sequence[str], cluster_id: str = "") -> list[str]:
        self.ledger.adopt(ids, cluster_id)
        self._save()
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
            again = sorted(k for k, why in self.ledger.released.items() if why == key) if msg.transfer_id else []
            if again:
                return again
            d = self.daemon
            await asyncio.wait_for(d.reconciled.wait(), self.settle_timeout)
            ids = pick_donations(d.view.machines(), set(d.view.inflight) | d.frozen_machines, msg.requirements,
                                 _deficit(msg.deficit))
            self.ledger.release(ids, key)
            self._save()
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
        again = sorted(k for k, why in self.ledger.released.items() if why == key) if msg.transfer_id else []
        if again:
            return again
        d = self.daemon
        await asyncio.wait_for(d.reconciled.wait(), self.settle_timeout)
        if msg.machine_ids:
            ids = [m for m in msg.machine_ids if d.view.get(m) is not None]
        else:
            ids = pick_drain_victims(d.view.machines(), set(d.view.inflight) | d.frozen_machines,
                                     msg.preemptor_priority, msg.requirements, _deficit(msg.deficit))
        victims = list(ids)
        d.frozen_machines.update(victims)  # the engine neither re-uses nor re-drains them meanwhile
        try:
            for mid in ids:
                m = d.view.machine(mid)
                if m is not None and m.state is MachineState.CONFIGURED:
                    d.executor.submit_drain(mid, 30, msg.preemptor_priority, "preempt")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.drain_timeout
            settled = (MachineState.IDLE, MachineState.FAILED)
            while True:
                states = [d.view.machine(mid) for mid in ids]
                if all(m is None or (m.state in settled and m.id not in d.view.inflight) for m in states):
                    break
                if loop.time() > deadline:
                    raise TimeoutError("cross-shard drain: victims did not drain in time")
                await asyncio.sleep(0.1)
            # Only drained (Idle) machines travel; a victim whose drain failed stays here, FAILED.
            ids = [mid for mid in ids if (m := d.view.machine(mid)) is not None and m.state is MachineState.IDLE]
            async with self._lock:
                self.ledger.release(ids, key)
                self._save()
                self._forget(ids)
        finally:
            d.frozen_machines.difference_update(victims)
            d.trigger()
        self._count("released", "drain", len(ids))
        log.info("cross-shard drain released", transfer=msg.transfer_id, to=msg.to_shard_id, machines=len(ids))
        return ids
