"""The coordinator daemon: a grpc.aio shell around the Raft-replicated FleetState.

Every RPC is served by the leader only. A follower forwards client RPCs to the
leader and relays its answer (coordinator/forward.py: one hop, the caller's
deadline, every RPC but ReportShard); where it cannot (ReportShard, no leader
known, a call already forwarded, the leader unreachable) it answers
FAILED_PRECONDITION ``coordinator: not leader`` with the leader's gRPC address
in the message (``leader=HOST:PORT``) and in trailing metadata
``bigfleet-leader``. Shard summaries and shortfalls are leader-local soft
state, refilled by the next reports after a failover; everything else goes
through Raft.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc
from prometheus_client import Counter, Gauge

from bigfleet.coordinator import requests as req
from bigfleet.coordinator import snapshot as snap
from bigfleet.coordinator.forward import NOT_LEADER_MESSAGE, SERVICE_NAME, LeaderForwarder
from bigfleet.coordinator.raft import RaftConfig, RaftError, RaftNode
from bigfleet.coordinator.rebalance import (
    FruitlessTransfer,
    ShardView,
    ShortfallView,
    cooling_shards,
    plan_inventory,
)
from bigfleet.coordinator.state import (
    ALREADY_EXISTS,
    CONFLICT,
    DONE,
    INVALID,
    KIND_CLUSTER,
    NOT_FOUND,
    OK,
    FleetState,
)
from bigfleet.coordinator.wire import (
    instruction_to_proto,
    requirements_to_json,
    resources_to_json,
    transfer_to_proto,
)
from bigfleet.observability import get_logger, new_registry, start_metrics_server
from bigfleet.observability.metrics import MetricsServer
from bigfleet.placement import DEFAULT_LOAD_FACTOR, place, plan_rebalance
from bigfleet.rpc import new_server
from bigfleet.rpc.options import NOT_SERVING, SERVING
from bigfleet.security.identity import Role
from bigfleet.security.roles import caller_role
from bigfleet.v1alpha1 import coordinator_pb2 as pb
from bigfleet.v1alpha1 import coordinator_pb2_grpc as pbg

LEADER_METADATA_KEY = "bigfleet-leader"
# Set on UNAVAILABLE answers that come from the coordinator's logic (retry later,
# same replica) rather than from a dead or unreachable replica.
RETRY_LATER_KEY = "bigfleet-retry-later"

_CODES = {
    NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    CONFLICT: grpc.StatusCode.FAILED_PRECONDITION,
}


@dataclass
class CoordinatorConfig:
    node_id: str
    listen: str
    raft_bind: str
    data_dir: Path
    password: str
    raft_advertise: str = ""
    raft_peers: list[str] = field(default_factory=list)
    advertise: str = ""
    metrics_listen: str = ""
    down_after: float = 60.0
    snapshot_export_dir: str = ""
    snapshot_export_interval: float = 300.0
    rebalance_interval: float = 10.0
    transfer_cooldown: float = 60.0
    load_factor: float = DEFAULT_LOAD_FACTOR
    join_addr: str = ""
    raft_election_min: float = 0.3
    raft_election_max: float = 0.6
    raft_compaction_entries: int = 20_000
    # bigfleet.security.tls.TLSConfig: mTLS for the gRPC server and the join client
    # (the replicas' certificate carries bigfleet://admin). None = plaintext.
    tls: Any = None

    @property
    def raft_address(self) -> str:
        return self.raft_advertise or _loopback_if_wildcard(self.raft_bind)


def _dialable(st: FleetState, shard_ids: list[str]) -> list[str]:
    """The shards an operator could dial: a shard that never reported its `shard_address` is no
    placement target (its clusters would be told an empty address)."""
    return [s for s in shard_ids if st.shards[s].address]


def _loopback_if_wildcard(addr: str) -> str:
    host, _, port = addr.rpartition(":")
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    return f"{host}:{port}"


@dataclass
class SoftReport:
    shard_id: str
    cycle: int
    epoch: int
    received_ns: int
    summary: pb.ShardSummary
    shortfalls: list[pb.Shortfall]


class _Metrics:
    def __init__(self) -> None:
        self.registry = new_registry(process_metrics=True)
        self.term = Gauge("bigfleet_coordinator_raft_term", "Current coordinator term", registry=self.registry)
        self.is_leader = Gauge("bigfleet_coordinator_is_leader", "1 on the Raft leader", registry=self.registry)
        self.apply = Counter(
            "bigfleet_coordinator_apply_total", "Raft writes by outcome", ["outcome"], registry=self.registry
        )
        self.pending = Gauge(
            "bigfleet_coordinator_pending_instructions", "Undelivered/unacked instructions", ["shard"], registry=self.registry
        )
        self.shards_live = Gauge("bigfleet_coordinator_shards_live", "Shards heard from recently", registry=self.registry)
        self.shards_down = Gauge("bigfleet_coordinator_shards_down", "Registered shards gone silent", registry=self.registry)
        self.clusters = Gauge("bigfleet_coordinator_cluster_bindings", "Bound clusters", registry=self.registry)
        self.transfers = Gauge(
            "bigfleet_coordinator_transfers_active", "Handoffs and inventory transfers in flight", ["kind"], registry=self.registry
        )
        self.forwarded = Counter(
            "bigfleet_coordinator_forwarded_total",
            "Client RPCs a follower forwarded to the leader, by outcome (OK, the leader's status code, or leader_unreachable)",
            ["method", "outcome"],
            registry=self.registry,
        )


class CoordinatorDaemon:
    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        self.log = get_logger("coordinator", node=cfg.node_id)
        self.metrics = _Metrics()
        self.raft: RaftNode | None = None
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.reports: dict[str, SoftReport] = {}
        #: shard → when its heartbeat was last written to the replicated state (at most every down_after / 4)
        self.heartbeat_written: dict[str, int] = {}
        self._bind_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._metrics_server: MetricsServer | None = None
        self._health: Any = None
        self._was_leader = False
        # Raft term in which this node, as leader, committed its barrier write:
        # only then has it applied every entry earlier leaders acknowledged.
        self._ready_term = -1
        self._barrier: asyncio.Task[None] | None = None
        self._forwarder: LeaderForwarder | None = None

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()  # never leave a Raft tick thread running (it would keep the process alive)
            raise

    async def _start(self) -> None:
        cfg = self.cfg
        self.raft = RaftNode(
            RaftConfig(
                self_address=cfg.raft_address,
                peers=cfg.raft_peers,
                data_dir=cfg.data_dir,
                password=cfg.password,
                bind_address=cfg.raft_bind,
                election_min=cfg.raft_election_min,
                election_max=cfg.raft_election_max,
                compaction_min_entries=cfg.raft_compaction_entries,
            )
        )
        from bigfleet.security.roles import COORDINATOR_POLICY, RoleInterceptor
        from bigfleet.security.tls import add_port

        # Roles per protocols.md §5.3 (shards report only as themselves, admin for
        # mutations, readonly|admin for reads); over plaintext every check passes.
        roles = RoleInterceptor(COORDINATOR_POLICY, registry=self.metrics.registry, component="coordinator")
        # After the role check: a follower forwards the (already authorised) call to the leader
        # with its own identity, the one it joins the group with.
        self._forwarder = LeaderForwarder(
            node_id=cfg.node_id,
            ready=self.ready,
            leader_hint=self.leader_hint,
            self_address=lambda: self.grpc_address,
            tls=cfg.tls,
            counter=self.metrics.forwarded,
        )
        self.server, self._health = new_server(interceptors=[roles, self._forwarder])
        pbg.add_CoordinatorServicer_to_server(CoordinatorService(self), self.server)
        self.port = add_port(self.server, cfg.listen, cfg.tls)
        await self.server.start()
        await self._health.set("", SERVING)
        await self._health.set(SERVICE_NAME, NOT_SERVING)
        if cfg.metrics_listen and cfg.metrics_listen != "0":
            self._metrics_server = start_metrics_server(cfg.metrics_listen, self.metrics.registry)
        for coro in (self._status_loop(), self._member_loop(), self._restore_loop(), self._rebalance_loop(), self._export_loop()):
            self._tasks.append(asyncio.create_task(coro))
        if cfg.join_addr:
            self._tasks.append(asyncio.create_task(self._join_loop()))
        self.log.info("coordinator started", listen=cfg.listen, port=self.port, raft=cfg.raft_address, peers=cfg.raft_peers)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.server is not None:
            await self.server.stop(1.0)
            self.server = None
        if self._forwarder is not None:
            await self._forwarder.close()
            self._forwarder = None
        if self.raft is not None:
            self.raft.destroy()
            self.raft = None
        if self._metrics_server is not None:
            self._metrics_server.stop()
            self._metrics_server = None

    @property
    def grpc_address(self) -> str:
        if self.cfg.advertise:
            return self.cfg.advertise
        host = self.cfg.listen.rpartition(":")[0]
        return _loopback_if_wildcard(f"{host}:{self.port}")

    def r(self) -> RaftNode:
        assert self.raft is not None
        return self.raft

    def leader_hint(self) -> str:
        leader = self.r().leader()
        if leader is None:
            return ""
        for m in self.r().read(lambda st: list(st.members.values())):
            if m.raft_address == leader:
                return m.grpc_address
        return ""

    # ---------------------------------------------------------------- write
    async def write(self, cmd: dict[str, Any], context: grpc.aio.ServicerContext | None = None) -> dict[str, Any]:
        try:
            res = await self.r().submit(cmd)
        except RaftError as exc:
            self.metrics.apply.labels("error").inc()
            if context is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            raise
        code = res.get("code", OK)
        self.metrics.apply.labels("success" if code == OK else "fsm_error").inc()
        if code != OK and context is not None:
            await context.abort(_CODES.get(code, grpc.StatusCode.INTERNAL), str(res.get("error", code)))
        return res

    # -------------------------------------------------------------- loops
    async def _status_loop(self) -> None:
        while True:
            try:
                raft = self.r()
                leader_known = raft.leader() is not None
                await self._health.set(SERVICE_NAME, SERVING if leader_known else NOT_SERVING)
                is_leader = raft.is_leader()
                if is_leader and self._ready_term != raft.raft_term() and (self._barrier is None or self._barrier.done()):
                    self._barrier = asyncio.create_task(self._leader_barrier())
                if is_leader != self._was_leader:
                    self.log.info("leadership changed", leader=is_leader, term=raft.term())
                    if is_leader:
                        self.reports.clear()
                        self.heartbeat_written.clear()
                    self._was_leader = is_leader
                self.metrics.term.set(raft.term())
                self.metrics.is_leader.set(1 if is_leader else 0)
                if is_leader:
                    now = time.time_ns()
                    down_ns = int(self.cfg.down_after * 1e9)

                    def gauges(
                        st: FleetState, now: int = now, down_ns: int = down_ns
                    ) -> tuple[dict[str, int], int, int, int, dict[str, int]]:
                        pend = {s: len(q) for s, q in st.queues.items()}
                        live = len(st.live_shards(now, down_ns))
                        kinds: dict[str, int] = {}
                        for t in st.active_transfers():
                            kinds[t.kind] = kinds.get(t.kind, 0) + 1
                        return pend, live, len(st.shards) - live, len(st.bindings), kinds

                    pend, live, down, clusters, kinds = raft.read(gauges)
                    for s, n in pend.items():
                        self.metrics.pending.labels(s).set(n)
                    self.metrics.shards_live.set(live)
                    self.metrics.shards_down.set(down)
                    self.metrics.clusters.set(clusters)
                    for k in ("cluster", "inventory", "drain"):
                        self.metrics.transfers.labels(k).set(kinds.get(k, 0))
            except Exception as exc:  # keep reporting health whatever happens
                self.log.warning("status loop error", error=repr(exc))
            await asyncio.sleep(0.02 if self.r().is_leader() and not self.ready() else 0.1)

    async def _leader_barrier(self) -> None:
        raft = self.r()
        term = raft.raft_term()
        try:
            await raft.submit({"op": "noop"}, timeout=2.0)
        except RaftError as exc:
            self.log.info("leader barrier failed", error=str(exc))
            return
        if raft.is_leader() and raft.raft_term() == term:
            self._ready_term = term
            self.log.info("leader ready", term=self.r().term())

    def ready(self) -> bool:
        """Leader *and* caught up: serves reads and writes."""
        raft = self.r()
        return raft.is_leader() and self._ready_term == raft.raft_term()

    async def _member_loop(self) -> None:
        """Record this replica's gRPC address in Raft so followers can hint at the leader."""
        me = {"op": "register_member", "node_id": self.cfg.node_id, "raft_address": self.cfg.raft_address, "grpc_address": self.grpc_address}
        while True:
            try:
                raft = self.r()

                def mine(st: FleetState) -> tuple[str, str] | None:
                    m = st.members.get(self.cfg.node_id)
                    return None if m is None else (m.raft_address, m.grpc_address)

                if raft.read(mine) == (me["raft_address"], me["grpc_address"]):
                    await asyncio.sleep(2.0)
                    continue
                if raft.leader() is not None:
                    # On a follower pysyncobj forwards this to the leader; it is idempotent,
                    # so a lost callback only costs a retry.
                    await raft.submit(me, timeout=2.0)
            except (RaftError, Exception) as exc:
                self.log.debug("member registration pending", error=repr(exc))
            await asyncio.sleep(0.3)

    async def _restore_loop(self) -> None:
        seed = snap.pending_restore(self.cfg.data_dir)
        if seed is None:
            return
        self.log.warning("restored snapshot pending; will propose it once leader", source_index=seed.get("source_index"))
        while True:
            if self.ready():
                try:
                    cmd = {"op": "restore", "state": seed["state"], "term_offset": seed["term_offset"], "incarnation": seed["incarnation"]}
                    await self.r().submit(cmd, timeout=10.0)
                    snap.clear_restore(self.cfg.data_dir)
                    self.log.info("restored snapshot committed")
                    return
                except RaftError as exc:
                    self.log.warning("restore write failed; retrying", error=str(exc))
            await asyncio.sleep(0.2)

    async def _export_loop(self) -> None:
        if not self.cfg.snapshot_export_dir:
            return
        interval = self.cfg.snapshot_export_interval or 300.0
        while True:
            await asyncio.sleep(interval)
            if not self.ready():
                continue
            try:
                meta, state = self.snapshot()
                if meta["Index"] > 0:
                    path = await asyncio.to_thread(snap.export, Path(self.cfg.snapshot_export_dir), meta, state, time.time())
                    self.log.info("snapshot exported", path=str(path), index=meta["Index"])
            except Exception as exc:
                self.log.warning("snapshot export failed", error=repr(exc))

    async def _rebalance_loop(self) -> None:
        if self.cfg.rebalance_interval <= 0:
            return
        while True:
            await asyncio.sleep(self.cfg.rebalance_interval)
            if not self.ready():
                continue
            try:
                await self.rebalance_inventory_once()
            except Exception as exc:
                self.log.warning("rebalance tick failed", error=repr(exc))

    async def rebalance_inventory_once(self) -> int:
        now = time.time_ns()
        down_ns = int(self.cfg.down_after * 1e9)

        def view(st: FleetState) -> tuple[list[str], set[str], dict[str, float], list[FruitlessTransfer]]:
            busy: set[str] = set()
            ended: dict[str, float] = {}
            fruitless: list[FruitlessTransfer] = []
            for t in st.transfers.values():
                if t.kind == KIND_CLUSTER:
                    continue
                if t.phase in ("releasing", "adopting"):
                    busy.update((t.from_shard, t.to_shard))
                elif not t.machine_ids:
                    # Done with nothing handed over, refused, failed or aborted: remembered so
                    # the planner asks another donor, or escalates, instead of asking again.
                    # Nothing moved, so there is nothing to oscillate: no cooldown.
                    fruitless.append(
                        FruitlessTransfer(
                            t.kind, t.from_shard, t.to_shard, t.preemptor_priority, t.requirements,
                            t.updated_at_ns / 1e9, t.donor_free,
                        )
                    )
                elif t.phase == DONE:
                    for s in (t.from_shard, t.to_shard):
                        ended[s] = max(ended.get(s, 0.0), t.updated_at_ns / 1e9)
            return st.live_shards(now, down_ns), busy, ended, fruitless

        live, busy, ended, fruitless = self.r().read(view)
        views = []
        for sid in live:
            rep = self.reports.get(sid)
            if rep is None:
                continue
            views.append(
                ShardView(
                    sid,
                    rep.summary.free_machines,
                    rep.summary.total_machines,
                    [
                        ShortfallView(s.priority, s.age_cycles, requirements_to_json(s.requirements),
                                      resources_to_json(s.deficit), resources_to_json(s.min_unit))
                        for s in rep.shortfalls
                    ],
                )
            )
        intents = plan_inventory(
            views,
            busy=busy,
            cooling=cooling_shards(ended, now / 1e9, self.cfg.transfer_cooldown),
            fruitless=fruitless,
            now=now / 1e9,
        )
        for it in intents:
            cmd = {
                "op": "start_transfer",
                "transfer_id": secrets.token_hex(8),
                "kind": it.kind,
                "from": it.donor,
                "to": it.recipient,
                "requirements": it.requirements,
                "deficit": it.deficit,
                "min_unit": it.min_unit,
                "preemptor_priority": it.priority,
                "donor_free": it.donor_free,
                "now": now,
            }
            res = await self.write(cmd)
            self.log.info(
                "inventory transfer", kind=it.kind, donor=it.donor, recipient=it.recipient, priority=it.priority,
                result=res.get("code"),
            )
        return len(intents)

    async def _join_loop(self) -> None:
        """Ask the group (via --join-addr) to add this replica until a leader is visible."""
        from bigfleet.coordclient.client import CoordinatorClient

        delay = 1.0
        client = CoordinatorClient([a for a in self.cfg.join_addr.split(",") if a], tls=self.cfg.tls)
        try:
            while self.r().leader() is None:
                try:
                    await client.call(
                        "JoinRaftCluster",
                        pb.JoinRaftClusterRequest(node_id=self.cfg.node_id, raft_address=self.cfg.raft_address),
                    )
                    self.log.info("join requested", via=self.cfg.join_addr)
                except Exception as exc:
                    self.log.info("join attempt failed", error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 15.0)
        finally:
            await client.close()

    # ------------------------------------------------------------ snapshot
    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        raft = self.r()

        def take(st: FleetState) -> tuple[dict[str, Any], list[dict[str, str]]]:
            return st.to_json(), [{"ID": m.node_id, "Address": m.raft_address} for m in st.members.values()]

        state, servers = raft.read(take)
        index, term = raft.last_applied(), raft.term()
        meta = {
            "ID": f"{term}-{index}-{int(time.time() * 1000)}",
            "Index": index,
            "Term": term,
            "Version": 1,
            "Configuration": {"Servers": servers},
            "Size": 0,
        }
        return meta, state


def _now() -> int:
    return time.time_ns()


class CoordinatorService(pbg.CoordinatorServicer):
    def __init__(self, d: CoordinatorDaemon) -> None:
        self.d = d

    async def _leader(self, context: grpc.aio.ServicerContext) -> None:
        if self.d.ready():
            return
        hint = self.d.leader_hint()
        if hint:
            context.set_trailing_metadata(((LEADER_METADATA_KEY, hint),))
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NOT_LEADER_MESSAGE + (f"; leader={hint}" if hint else ""))

    @staticmethod
    async def _invalid(context: grpc.aio.ServicerContext, msg: str) -> NoReturn:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, msg)
        raise AssertionError("unreachable")

    async def _valid(self, context: grpc.aio.ServicerContext, check: Callable[..., object], *fields: object) -> None:
        """Run one of `requests`' checks; a `BadRequest` answers INVALID_ARGUMENT with its text."""
        try:
            check(*fields)
        except req.BadRequest as exc:
            await self._invalid(context, str(exc))

    # --------------------------------------------------------- heartbeat
    async def ReportShard(self, request: pb.ShardReport, context: grpc.aio.ServicerContext) -> pb.ReportAck:
        sid = request.shard_id
        await self._valid(context, req.check_report, request)
        await self._leader(context)
        d = self.d
        now = _now()
        entry = d.r().read(lambda st: st.shards.get(sid))
        prev = d.reports.get(sid)
        # Reports can arrive out of order (retries); an older cycle of the same epoch updates nothing.
        in_order = prev is None or request.shard_epoch != prev.epoch or request.cycle >= prev.cycle
        provider = request.summary.provider_address if in_order and request.HasField("summary") else None
        hb_every = int(d.cfg.down_after * 1e9 / 4)
        if (
            entry is None
            or now - d.heartbeat_written.get(sid, 0) > hb_every
            or (request.shard_address and entry.address != request.shard_address)
            or (provider is not None and entry.provider_address != provider)
        ):
            cmd: dict[str, Any] = {"op": "heartbeat", "shard_id": sid, "now": now, "address": request.shard_address}
            if provider is not None:
                cmd["provider_address"] = provider
            await d.write(cmd, context)
            d.heartbeat_written[sid] = now
        if in_order:
            # (a report without a summary, e.g. a new shard leader before its first reconcile, keeps
            # the last one rather than showing an empty fleet)
            summary = request.summary if request.HasField("summary") or prev is None else prev.summary
            d.reports[sid] = SoftReport(sid, request.cycle, request.shard_epoch, now, summary, list(request.shortfalls)[:100])
        if request.instruction_acks:
            acks = [
                {"id": a.instruction_id, "outcome": int(a.outcome), "reason": a.reason, "machine_ids": list(a.machine_ids)}
                for a in request.instruction_acks
            ]
            ack_cmd: dict[str, Any] = {"op": "ack", "shard_id": sid, "now": now, "acks": acks}
            if request.HasField("summary"):
                # The free count beside an empty release: the rebalancer asks that donor
                # again only once it has more free machines than this.
                ack_cmd["free_machines"] = request.summary.free_machines
            await d.write(ack_cmd, context)
        term = d.r().term()
        pending = d.r().read(lambda st: st.pending(sid))
        return pb.ReportAck(
            coordinator_term=term, acknowledged=True, instructions=[instruction_to_proto(i, term) for i in pending]
        )

    # ------------------------------------------------------------- admin
    async def AssignDomain(self, request: pb.AssignDomainRequest, context: grpc.aio.ServicerContext) -> pb.AssignDomainResponse:
        if not (request.topology_key and request.topology_value and request.shard_id):
            await self._invalid(context, "topology_key, topology_value and shard_id are required")
        await self._valid(context, req.check_domain, request.topology_key, request.topology_value)
        await self._leader(context)
        cmd = {"op": "assign_domain", "key": request.topology_key, "value": request.topology_value, "shard_id": request.shard_id, "now": _now()}
        await self.d.write(cmd, context)
        return pb.AssignDomainResponse()

    async def UnassignDomain(
        self, request: pb.UnassignDomainRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnassignDomainResponse:
        if not (request.topology_key and request.topology_value):
            await self._invalid(context, "topology_key and topology_value are required")
        await self._leader(context)
        await self.d.write({"op": "unassign_domain", "key": request.topology_key, "value": request.topology_value, "now": _now()}, context)
        return pb.UnassignDomainResponse()

    async def RemoveShard(self, request: pb.RemoveShardRequest, context: grpc.aio.ServicerContext) -> pb.RemoveShardResponse:
        if not request.shard_id:
            await self._invalid(context, "shard_id is required")
        await self._leader(context)
        await self.d.write({"op": "remove_shard", "shard_id": request.shard_id, "now": _now()}, context)
        self.d.reports.pop(request.shard_id, None)
        return pb.RemoveShardResponse()

    # -------------------------------------------------------------- reads
    async def ListShards(self, request: pb.ListShardsRequest, context: grpc.aio.ServicerContext) -> pb.ListShardsResponse:
        await self._leader(context)
        shards = self.d.r().read(lambda st: sorted(st.shards.values(), key=lambda s: s.shard_id))
        return pb.ListShardsResponse(
            shards=[
                pb.ShardRegistryEntry(
                    shard_id=s.shard_id, address=s.address, registered_at_unix_ns=s.registered_at_ns, last_heartbeat_unix_ns=s.last_heartbeat_ns
                )
                for s in shards
            ]
        )

    async def ListDomainAssignments(
        self, request: pb.ListDomainAssignmentsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListDomainAssignmentsResponse:
        await self._leader(context)
        rows = self.d.r().read(lambda st: sorted(st.domains.values(), key=lambda r: (r[2], r[0], r[1])))
        return pb.ListDomainAssignmentsResponse(
            assignments=[pb.DomainAssignment(topology_key=k, topology_value=v, shard_id=s) for k, v, s in rows]
        )

    async def ListShardReports(
        self, request: pb.ListShardReportsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListShardReportsResponse:
        await self._leader(context)
        out = []
        for sid in sorted(self.d.reports):
            if request.shard_id and sid != request.shard_id:
                continue
            r = self.d.reports[sid]
            sfs = []
            for s in r.shortfalls:
                c = pb.Shortfall()
                c.CopyFrom(s)
                del c.requirements[:]
                sfs.append(c)
            out.append(pb.ShardReportSnapshot(shard_id=sid, cycle=r.cycle, received_at_unix_ns=r.received_ns, summary=r.summary, shortfalls=sfs))
        return pb.ListShardReportsResponse(reports=out)

    # -------------------------------------------------------- placement
    async def LookupCluster(
        self, request: pb.LookupClusterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LookupClusterResponse:
        cid = request.cluster_id
        await self._valid(context, req.check_id, cid, "cluster_id")
        await self._leader(context)
        d = self.d
        found = await self._existing(cid, context)
        if found is not None:
            return found
        if caller_role(context) is Role.READONLY:
            # Placing a cluster is a Raft write; readonly may only see bindings that exist.
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"cluster {cid} is not bound to a shard (a readonly identity does not place clusters; "
                "the cluster's operator or an admin does)",
            )
        async with d._bind_lock:
            found = await self._existing(cid, context)
            if found is not None:
                return found
            now = _now()
            down_ns = int(d.cfg.down_after * 1e9)
            live, loads = d.r().read(lambda st: (_dialable(st, st.live_shards(now, down_ns)), dict(st.load)))
            target = place(cid, live, loads, d.cfg.load_factor)
            if target is None:
                context.set_trailing_metadata(((RETRY_LATER_KEY, "no-live-shard"),))
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no live shard to place the cluster on")
            res = await d.write({"op": "bind_cluster", "cluster_id": cid, "shard_id": target, "now": now}, context)
        shard = res["shard_id"]
        addr = d.r().read(lambda st: st.shards[shard].address if shard in st.shards else "")
        d.log.info("cluster bound", cluster=cid, shard=shard, newly=res.get("newly_bound"))
        return pb.LookupClusterResponse(
            cluster_id=cid, shard_id=shard, shard_address=addr, newly_bound=bool(res.get("newly_bound")), binding_epoch=int(res.get("epoch", 1))
        )

    async def _existing(self, cid: str, context: grpc.aio.ServicerContext) -> pb.LookupClusterResponse | None:
        def find(st: FleetState) -> tuple[str, str, int, bool] | None:
            b = st.bindings.get(cid)
            if b is None:
                return None
            moving = st.active_transfer_for_cluster(cid) is not None
            addr = st.shards[b.shard_id].address if b.shard_id in st.shards else ""
            return b.shard_id, addr, b.epoch, moving

        got = self.d.r().read(find)
        if got is None:
            return None
        shard, addr, epoch, moving = got
        if moving:
            context.set_trailing_metadata(((RETRY_LATER_KEY, "handoff"),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cluster {cid} is being handed off; retry shortly")
        return pb.LookupClusterResponse(cluster_id=cid, shard_id=shard, shard_address=addr, binding_epoch=epoch)

    async def ListClusterBindings(
        self, request: pb.ListClusterBindingsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListClusterBindingsResponse:
        await self._leader(context)

        def rows(st: FleetState) -> list[pb.ClusterBinding]:
            moving = {t.cluster_id: t for t in st.active_transfers() if t.kind == KIND_CLUSTER}
            out = []
            for c, b in sorted(st.bindings.items()):
                t = moving.get(c)
                out.append(
                    pb.ClusterBinding(
                        cluster_id=c,
                        shard_id=b.shard_id,
                        bound_at_unix_ns=b.bound_at_ns,
                        binding_epoch=b.epoch,
                        handoff_to_shard_id=t.to_shard if t else "",
                        handoff_phase=t.phase if t else "",
                    )
                )
            return out

        return pb.ListClusterBindingsResponse(bindings=self.d.r().read(rows))

    async def GetClusterStatus(
        self, request: pb.GetClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetClusterStatusResponse:
        """LookupCluster without its side effect (no binding is created) and without refusing during a handoff."""
        cid = request.cluster_id
        if not cid:
            await self._invalid(context, "cluster_id is required")
        await self._leader(context)

        def status(st: FleetState) -> pb.GetClusterStatusResponse:
            b = st.bindings.get(cid)
            if b is None:
                return pb.GetClusterStatusResponse(cluster_id=cid)
            t = st.active_transfer_for_cluster(cid)
            return pb.GetClusterStatusResponse(
                cluster_id=cid, bound=True, shard_id=b.shard_id, binding_epoch=b.epoch,
                handoff_to_shard_id=t.to_shard if t is not None else "", handoff_phase=t.phase if t is not None else "",
            )

        return self.d.r().read(status)

    async def _plan(self, load_factor: float, max_moves: int) -> Any:
        d = self.d
        now = _now()
        down_ns = int(d.cfg.down_after * 1e9)

        def inputs(st: FleetState) -> tuple[Any, ...]:
            frozen = [t.cluster_id for t in st.active_transfers() if t.kind == KIND_CLUSTER]
            joined = {s.shard_id: s.registered_at_ns for s in st.shards.values()}
            bound = {c: b.bound_at_ns for c, b in st.bindings.items()}
            return st.cluster_map(), st.live_shards(now, down_ns), frozen, joined, bound

        bindings, live, frozen, joined, bound = d.r().read(inputs)
        # O(clusters x shards) hashing: keep it off the event loop.
        return await asyncio.to_thread(
            plan_rebalance, bindings, live, load_factor or d.cfg.load_factor, max_moves, frozen, joined, bound
        )

    async def PlanRebalance(
        self, request: pb.PlanRebalanceRequest, context: grpc.aio.ServicerContext
    ) -> pb.PlanRebalanceResponse:
        await self._valid(context, req.check_load_factor, request.load_factor)
        if request.max_moves < 0:
            await self._invalid(context, "max_moves must be >= 0")
        await self._leader(context)
        plan = await self._plan(request.load_factor, request.max_moves)
        return pb.PlanRebalanceResponse(
            moves=[pb.ClusterMove(cluster_id=m.cluster_id, from_shard_id=m.from_shard, to_shard_id=m.to_shard) for m in plan.moves],
            total_clusters=plan.total_clusters,
            live_shards=len(plan.live_shards),
            load_before=plan.load_before,
            load_after=plan.load_after,
            plan_id=plan.plan_id,
            stranded_clusters=plan.stranded,
        )

    async def ApplyRebalance(
        self, request: pb.ApplyRebalanceRequest, context: grpc.aio.ServicerContext
    ) -> pb.ApplyRebalanceResponse:
        await self._valid(context, req.check_load_factor, request.load_factor)
        if request.max_moves < 0:
            await self._invalid(context, "max_moves must be >= 0")
        await self._leader(context)
        plan = await self._plan(request.load_factor, request.max_moves)
        if request.expected_plan_id and request.expected_plan_id != plan.plan_id:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"plan changed: expected {request.expected_plan_id}, current {plan.plan_id}"
            )
        moves = [
            {"cluster_id": m.cluster_id, "from": m.from_shard, "to": m.to_shard, "transfer_id": secrets.token_hex(8)} for m in plan.moves
        ]
        res = await self.d.write({"op": "start_handoffs", "moves": moves, "now": _now()}, context)
        self.d.log.info("rebalance applied", started=len(res["started"]), skipped=len(res["skipped"]), plan=plan.plan_id)
        return pb.ApplyRebalanceResponse(
            started=[pb.ClusterMove(cluster_id=m["cluster_id"], from_shard_id=m["from"], to_shard_id=m["to"]) for m in res["started"]],
            plan_id=plan.plan_id,
        )

    async def ListTransfers(self, request: pb.ListTransfersRequest, context: grpc.aio.ServicerContext) -> pb.ListTransfersResponse:
        await self._leader(context)
        rows = self.d.r().read(lambda st: [transfer_to_proto(t) for t in sorted(st.transfers.values(), key=lambda t: (t.created_at_ns, t.transfer_id))])
        return pb.ListTransfersResponse(transfers=rows)

    async def AbortTransfer(self, request: pb.AbortTransferRequest, context: grpc.aio.ServicerContext) -> pb.AbortTransferResponse:
        if not request.transfer_id:
            await self._invalid(context, "transfer_id is required")
        await self._leader(context)
        await self.d.write({"op": "abort_transfer", "transfer_id": request.transfer_id, "now": _now()}, context)
        t = self.d.r().read(lambda st: st.transfers.get(request.transfer_id))
        return pb.AbortTransferResponse(transfer=transfer_to_proto(t) if t is not None else None)

    # ----------------------------------------------------- raft & backup
    async def JoinRaftCluster(
        self, request: pb.JoinRaftClusterRequest, context: grpc.aio.ServicerContext
    ) -> pb.JoinRaftClusterResponse:
        if not request.node_id or not request.raft_address:
            await self._invalid(context, "node_id and raft_address are required")
        await self._valid(context, req.check_id, request.node_id, "node_id")
        await self._valid(context, req.check_address, request.raft_address, "raft_address")
        await self._leader(context)
        raft = self.d.r()
        if request.raft_address in raft.members():
            return pb.JoinRaftClusterResponse()
        # A member that never answers still counts towards the quorum once added (a group of one
        # would stop committing for good): only a replica already listening is added.
        left = context.time_remaining()  # (the probe's retries end well inside the caller's deadline)
        unreachable = await _unreachable(request.raft_address, settle=5.0 if left is None else min(5.0, left / 2))
        if unreachable:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"raft_address {request.raft_address} is not reachable ({unreachable}); start the "
                                "replica first, nothing was changed")
        try:
            await raft.add_node(request.raft_address)
        except RaftError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        self.d.log.info("raft member added", node=request.node_id, raft=request.raft_address)
        return pb.JoinRaftClusterResponse()

    async def SnapshotSave(
        self, request: pb.SnapshotSaveRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SnapshotSaveChunk]:
        await self._leader(context)
        try:
            meta, state = self.d.snapshot()
        except Exception as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"snapshot: {exc}")
        if meta["Index"] <= 0:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no snapshot yet")
        data = json.dumps(state, sort_keys=True).encode()
        meta["Size"] = len(data)  # (as upstream's SnapshotMeta: the bytes of state that follow)
        yield pb.SnapshotSaveChunk(meta_json=json.dumps(meta, sort_keys=True).encode())
        for off in range(0, len(data), snap.CHUNK):
            yield pb.SnapshotSaveChunk(data=data[off : off + snap.CHUNK])


async def _unreachable(address: str, timeout: float = 3.0, settle: float = 5.0) -> str:
    """Why a TCP connection to `address` (HOST:PORT) failed, or "" once one opened. A refused
    connection is tried again for `settle` seconds: a replica started just before the join binds
    its Raft port from its own thread a moment after its process is up."""
    host, port = req.check_address(address, "raft_address")
    deadline = asyncio.get_running_loop().time() + settle
    while True:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except TimeoutError as exc:
            return str(exc) or type(exc).__name__
        except OSError as exc:
            if asyncio.get_running_loop().time() >= deadline:
                return str(exc) or type(exc).__name__
            await asyncio.sleep(0.2)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return ""
