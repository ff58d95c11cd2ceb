"""The Helm chart's topology as real processes on loopback, for tests/topology.

* a coordinator Raft group (``CoordGroup``),
* ONE fake provider behind a recording spy (every lifecycle call with its machine, fencing token,
  outcome and time),
* shard replica groups (``bigfleet shard --raft-bind ... --raft-peers ...``), shard-0 with
  ``--ownership exclusive`` and every other shard ``--ownership shared``, all with ``--coordinator``,
* operator stand-ins (``RoutedOperator``) that find their shard through the coordinator
  (``LookupCluster``), follow ``bigfleet-redirect`` (a follower's pointer to its leader, or the old
  shard's pointer after a cluster handoff) and re-resolve when their shard goes away or stops
  answering, each keeping a timestamped record of every frame it received,

and the invariants the test checks against the spy's record (``violations``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from shard.opsim import FakeOperator, need

from bigfleet.coordclient.client import CoordinatorClient, CoordinatorUnavailable
from bigfleet.rpc import insecure_channel, new_server
from bigfleet.testing import ManagedProcess, free_port
from bigfleet.v1alpha1 import (
    coordinator_pb2,
    provider_pb2,
    provider_pb2_grpc,
    shard_pb2,
    shardread_pb2,
    shardread_pb2_grpc,
)

RAFT_PASSWORD = "test-topology-shard-raft"
REDIRECT = "bigfleet-redirect"
MUTATING = ("Create", "Configure", "Drain", "Delete")
S = provider_pb2.MachineState
TRANSITIONAL = (S.MACHINE_STATE_CREATING, S.MACHINE_STATE_CONFIGURING, S.MACHINE_STATE_DRAINING,
                S.MACHINE_STATE_DELETING)


async def until(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """The predicate's first truthy value (sync or async predicate); TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            v = pred()
            if asyncio.iscoroutine(v):
                v = await v
            if v:
                return v
        except (grpc.RpcError, OSError, AssertionError, LookupError, CoordinatorUnavailable) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}" + (f" (last: {last!r})" if last else ""))
        await asyncio.sleep(interval)


# --------------------------------------------------------------------------- the recording spy
@dataclass
class Call:
    rpc: str
    machine_id: str
    shard_id: str
    epoch: int
    cluster: str  # Configure's cluster_id ("" for the other calls)
    t0: float  # monotonic, when the call reached the spy
    wall: float  # time.time() at t0 (compared with the coordinator's transfer stamps)
    t1: float = 0.0  # monotonic, when the provider answered
    code: grpc.StatusCode = grpc.StatusCode.OK

    @property
    def ok(self) -> bool:
        return self.code == grpc.StatusCode.OK


class RecordingProvider(provider_pb2_grpc.CapacityProviderServicer):
    """A pass-through in front of the one fake provider; every lifecycle call is recorded."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.channel = insecure_channel(upstream)
        self.stub = provider_pb2_grpc.CapacityProviderStub(self.channel)
        self.calls: list[Call] = []

    async def _fwd(self, rpc: str, req: Any, context: grpc.aio.ServicerContext) -> Any:
        remaining = context.time_remaining()
        call = None
        if rpc in MUTATING:
            call = Call(rpc, req.machine_id, req.shard_id, req.shard_epoch, getattr(req, "cluster_id", ""),
                        time.monotonic(), time.time())
            self.calls.append(call)
        try:
            resp = await getattr(self.stub, rpc)(req, timeout=remaining if remaining is not None else 30)
        except grpc.aio.AioRpcError as exc:
            if call is not None:
                call.t1, call.code = time.monotonic(), exc.code()
            await context.abort(exc.code(), exc.details() or "")
        if call is not None:
            call.t1 = time.monotonic()
        return resp

    async def Create(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Create", request, context)

    async def Configure(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Configure", request, context)

    async def Drain(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Drain", request, context)

    async def Delete(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Delete", request, context)

    async def Get(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Get", request, context)

    async def List(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("List", request, context)

    # -- views ---------------------------------------------------------------------------------
    def mutating(self, shard_id: str | None = None, since: float = 0.0, ok_only: bool = False) -> list[Call]:
        return [c for c in self.calls if (shard_id is None or c.shard_id == shard_id) and c.t0 >= since
                and (c.ok or not ok_only)]

    async def machines(self) -> list[provider_pb2.Machine]:
        return list((await self.stub.List(provider_pb2.ListFilter(), timeout=10)).machines)


# --------------------------------------------------------------------------- shard replica groups
@dataclass
class ShardReplica:
    shard_id: str
    name: str
    args: list[str]
    listen: str
    data_dir: str
    log_dir: Path
    proc: ManagedProcess | None = None
    stopped: bool = False  # SIGSTOPped by the test

    def start(self) -> ShardReplica:
        self.proc = ManagedProcess.bigfleet(self.args, f"{self.shard_id}-{self.name}", log_dir=self.log_dir,
                                            env={"BIGFLEET_SHARD_RAFT_PASSWORD": RAFT_PASSWORD}).start()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    async def health(self, timeout: float = 1.0) -> int:
        async with insecure_channel(self.listen) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return int(r.status)

    async def serving(self) -> bool:
        if not self.alive() or self.stopped:
            return False
        try:
            return await self.health() == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            return False

    async def actuation(self) -> shardread_pb2.ActuationStatus:
        async with insecure_channel(self.listen) as ch:
            r: shardread_pb2.ActuationStatus = await shardread_pb2_grpc.ShardAdminStub(ch).GetActuation(
                shardread_pb2.GetActuationRequest(), timeout=5)
            return r

    async def set_actuation(self, paused: bool, reason: str = "") -> shardread_pb2.ActuationStatus:
        async with insecure_channel(self.listen) as ch:
            r: shardread_pb2.ActuationStatus = await shardread_pb2_grpc.ShardAdminStub(ch).SetActuation(
                shardread_pb2.SetActuationRequest(paused=paused, reason=reason), timeout=10)
            return r

    async def counts(self, cluster_id: str = "") -> shardread_pb2.InventoryCounts:
        async with insecure_channel(self.listen) as ch:
            r: shardread_pb2.InventoryCounts = await shardread_pb2_grpc.ShardReadStub(ch).GetInventoryCounts(
                shardread_pb2.InventoryCountsRequest(cluster_id=cluster_id), timeout=5)
            return r

    def logs(self) -> str:
        return self.proc.logs() if self.proc else ""


@dataclass
class ShardGroup:
    shard_id: str
    ownership: str
    provider: str
    coordinator: list[str]
    root: Path
    size: int = 3
    extra: tuple[str, ...] = ()
    replicas: list[ShardReplica] = field(default_factory=list)

    def __post_init__(self) -> None:
        rafts = [f"127.0.0.1:{free_port()}" for _ in range(self.size)]
        for i in range(self.size):
            listen = f"127.0.0.1:{free_port()}"
            data_dir = tempfile.mkdtemp(prefix=f"bigfleet-topo-{self.shard_id}-r{i}-", dir=self.root)
            args = ["shard", "--shard-id", self.shard_id, "--replica-id", f"r{i}", "--listen", listen,
                    "--provider", self.provider, "--data-dir", data_dir, "--raft-bind", rafts[i],
                    "--raft-peers", ",".join(r for j, r in enumerate(rafts) if j != i),
                    "--ownership", self.ownership, "--coordinator", ",".join(self.coordinator),
                    "--log-format", "console", *self.extra]
            self.replicas.append(ShardReplica(self.shard_id, f"r{i}", args, listen, data_dir, self.root / "logs"))

    def start(self) -> ShardGroup:
        for r in self.replicas:
            r.start()
        return self

    def by_address(self, addr: str) -> ShardReplica | None:
        return next((r for r in self.replicas if r.listen == addr), None)

    async def leader(self, timeout: float = 60, exclude: Iterable[ShardReplica] = ()) -> ShardReplica:
        skip = list(exclude)

        async def find() -> ShardReplica | None:
            for r in self.replicas:
                if all(r is not x for x in skip) and await r.serving():
                    return r
            return None

        found: ShardReplica = await until(find, timeout, f"a serving {self.shard_id} leader")
        return found

    def signal_all_cont(self) -> None:
        for r in self.replicas:
            if r.stopped and r.proc is not None:
                r.proc.signal(signal.SIGCONT)
                r.stopped = False

    def stop(self) -> None:
        self.signal_all_cont()
        for r in self.replicas:
            if r.proc is not None:
                r.proc.stop(timeout=5)


# --------------------------------------------------------------------------- operator stand-ins
@dataclass
class Frame:
    at: float  # monotonic, when the operator read it
    target: str  # the shard address the session was open to
    msg: shard_pb2.ShardMessage


class RoutedOperator:
    """A FakeOperator that finds its shard the way a real operator does.

    Resolution: ``LookupCluster`` on the coordinator, else the last ``bigfleet-redirect`` trailer it
    was given (a follower naming its leader, or the old shard naming the new one after a handoff).
    It resends its roll-up every ``resend`` seconds and when the demand changes; a session that ends,
    or whose roll-up stays unacknowledged for ``ack_timeout`` (a SIGSTOPped leader holds the stream
    open and silent), is dropped and the shard resolved again. Bootstrap requests and reclaim
    instructions are answered by FakeOperator; every frame is kept with its arrival time.
    """

    def __init__(self, coordinator: list[str], cluster_id: str, cpu: str = "4", priority: int = 100,
                 count: int = 1, resend: float = 1.0, ack_timeout: float = 6.0, cached: str = "") -> None:
        self.coordinator = coordinator
        self.cached = cached  # an address to try first (an operator's cached lookup answer)
        self.cluster_id = cluster_id
        self.cpu, self.priority, self.count = cpu, priority, count
        self.resend, self.ack_timeout = resend, ack_timeout
        self.frames: list[Frame] = []
        self.sessions: list[tuple[float, str, str]] = []  # (opened at, target, how it was found)
        self.ended: list[tuple[float, str, str, str]] = []  # (at, target, code, why) per session end
        self.target = ""
        self._version = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._client = CoordinatorClient(coordinator, timeout=5.0)

    # -- demand --------------------------------------------------------------------------------
    def set_count(self, count: int) -> None:
        self.count = count
        self._version += 1

    def needs(self) -> list[Any]:
        return [need(self.cpu, priority=self.priority, count=self.count)]

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> RoutedOperator:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"operator-{self.cluster_id}")
        return self

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._client.close()

    async def _run(self) -> None:
        redirect = ""
        if self.cached:
            redirect = await self._session(self.cached, "cached")
        while not self._stop.is_set():
            how = "redirect"
            target, redirect = redirect, ""
            if not target:
                how = "lookup"
                try:
                    r = await self._client.call("LookupCluster",
                                                coordinator_pb2.LookupClusterRequest(cluster_id=self.cluster_id))
                    target = r.shard_address
                except Exception as exc:  # no leader yet, or UNAVAILABLE while being handed off
                    self.ended.append((time.monotonic(), "", "lookup", str(exc)[:200]))
                    await asyncio.sleep(0.3)
                    continue
            redirect = await self._session(target, how)
            if not redirect:
                await asyncio.sleep(0.2)

    async def _session(self, target: str, how: str) -> str:
        """One Session; returns the redirect it ended with ('' when none)."""
        self.target = target

        def on_frame(msg: shard_pb2.ShardMessage, target: str = target) -> None:
            self.frames.append(Frame(time.monotonic(), target, msg))

        op = FakeOperator(target, self.cluster_id, on_frame=on_frame)
        self.sessions.append((time.monotonic(), target, how))
        try:
            await op.__aenter__()
            why = await self._drive(op)
        except Exception as exc:
            # A replica that refuses at once (a follower) can end the call while the Hello or the first
            # roll-up is being written: the write fails before the reader has seen the status.
            why = f"write failed: {exc!r}"[:200]
        code, redirect = await self._outcome(op)
        self.ended.append((time.monotonic(), target, code, f"{why}: {op.details}"[:300]
                           + (f" -> {redirect}" if redirect else "")))
        if hasattr(op, "_reader"):
            await op.close()
        else:
            with contextlib.suppress(Exception):
                await op._channel.close()
        return redirect

    @staticmethod
    async def _outcome(op: FakeOperator) -> tuple[str, str]:
        """(status code, bigfleet-redirect) of a finished call; ('-', '') when it has not finished (a
        silent, SIGSTOPped shard): nothing to follow then."""
        call = getattr(op, "_call", None)
        if call is None:
            return "-", ""
        # The reader's status first: a write racing the server's refusal can end the call locally
        # with INTERNAL, losing the refusal's trailers, while the reader still saw them.
        reader = getattr(op, "_reader", None)
        if reader is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(reader), 1.0)
        if op.status is not None and op.status != grpc.StatusCode.INTERNAL:
            return op.status.name, dict(op.trailers).get(REDIRECT, "")
        try:
            code = await asyncio.wait_for(call.code(), 1.0)
            md = await asyncio.wait_for(call.trailing_metadata(), 1.0)
        except Exception:
            return "-", ""
        return code.name, str(dict(md or ()).get(REDIRECT, ""))

    async def _drive(self, op: FakeOperator) -> str:
        loop = asyncio.get_running_loop()
        sent_version, sent_at = -1, 0.0
        pending_since: float | None = None  # first unacknowledged send
        acks_then = 0
        # Like the real operator: nothing is written before the Hello is answered, so a refusal
        # arrives whole (with its redirect) rather than racing a roll-up write.
        while not op.acks("hello") and op.status is None and not self._stop.is_set():
            await asyncio.sleep(0.02)
        while not self._stop.is_set():
            if op.status is not None:
                return "ended"
            now = loop.time()
            n = len(op.acks("rollup"))
            if pending_since is not None and n > acks_then:
                pending_since = None
            if pending_since is not None and now - pending_since > self.ack_timeout:
                return "roll-up not acknowledged"
            if sent_version != self._version or now - sent_at >= self.resend:
                sent_version, sent_at = self._version, now
                if pending_since is None:
                    pending_since, acks_then = now, n
                await op.send_rollup(self.needs())
            await asyncio.sleep(0.05)
        return "stopped"

    # -- what arrived --------------------------------------------------------------------------
    def of(self, kind: str) -> list[Frame]:
        return [f for f in self.frames if f.msg.WhichOneof("payload") == kind]

    def reclaims(self, since: float = 0.0) -> list[Frame]:
        return [f for f in self.of("reclaim_instruction") if f.at >= since]

    def node_names(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for f in self.of("node_state_update"):
            u = f.msg.node_state_update
            if u.node_name:
                out.setdefault(u.machine_id, set()).add(u.node_name)
        return out

    def last_ack_epoch(self, target: str | None = None, since: float = 0.0) -> int:
        """The shard epoch of the newest acknowledgement (of a session to ``target``, after ``since``)."""
        for f in reversed(self.of("ack")):
            if f.at >= since and (target is None or f.target == target):
                return int(f.msg.ack.shard_epoch)
        return 0

    def acked_rollup(self, target: str, since: float) -> bool:
        return any(f.msg.ack.echo == "rollup" and f.target == target and f.at >= since for f in self.of("ack"))

    def failed_updates(self) -> list[shard_pb2.NodeStateUpdate]:
        return [f.msg.node_state_update for f in self.of("node_state_update")
                if f.msg.node_state_update.state == S.MACHINE_STATE_FAILED]


# --------------------------------------------------------------------------- the fleet
@dataclass
class Fleet:
    root: Path
    coord: Any  # CoordGroup
    provider_proc: ManagedProcess
    spy: RecordingProvider
    spy_server: grpc.aio.Server
    spy_addr: str
    groups: dict[str, ShardGroup] = field(default_factory=dict)
    operators: dict[str, RoutedOperator] = field(default_factory=dict)
    client: CoordinatorClient | None = None

    async def call(self, method: str, req: Any, timeout: float = 10.0) -> Any:
        assert self.client is not None
        return await self.client.call(method, req, timeout=timeout)

    async def shards(self) -> dict[str, str]:
        r = await self.call("ListShards", coordinator_pb2.ListShardsRequest())
        return {s.shard_id: s.address for s in r.shards}

    async def binding(self, cluster_id: str) -> str:
        r = await self.call("LookupCluster", coordinator_pb2.LookupClusterRequest(cluster_id=cluster_id))
        return str(r.shard_id)

    async def transfers(self) -> list[coordinator_pb2.TransferStatus]:
        r = await self.call("ListTransfers", coordinator_pb2.ListTransfersRequest())
        return list(r.transfers)

    def shard_of(self, addr: str) -> str:
        for sid, g in self.groups.items():
            if g.by_address(addr) is not None:
                return sid
        return ""

    async def configured(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in await self.spy.machines():
            if m.cluster and m.state == S.MACHINE_STATE_CONFIGURED:
                out[m.cluster] = out.get(m.cluster, 0) + 1
        return out

    async def settled(self, want: dict[str, int]) -> bool:
        """Exactly ``want`` CONFIGURED per cluster and nothing in a transition."""
        ms = await self.spy.machines()
        if any(m.state in TRANSITIONAL for m in ms):
            return False
        got: dict[str, int] = {}
        for m in ms:
            if m.cluster and m.state == S.MACHINE_STATE_CONFIGURED:
                got[m.cluster] = got.get(m.cluster, 0) + 1
        return got == {c: n for c, n in want.items() if n}

    def dump(self) -> None:
        for g in self.groups.values():
            for r in g.replicas:
                print(f"---- {r.shard_id}/{r.name} ({r.listen}) log tail ----\n" + r.logs()[-6000:])
        print("---- provider log tail ----\n" + self.provider_proc.logs()[-2000:])
        print("---- coordinator log tail ----\n" + self.coord.logs()[-4000:])
        for op in self.operators.values():
            print(f"---- operator {op.cluster_id}: sessions {op.sessions[-12:]}\n   ended {op.ended[-12:]}")
        for c in self.spy.calls[-80:]:
            print(f"call {c.rpc} {c.machine_id} {c.shard_id}@{c.epoch} {c.cluster} {c.code.name} t={c.t0:.2f}")

    async def close(self) -> None:
        for op in self.operators.values():
            await op.stop()
        for g in self.groups.values():
            g.signal_all_cont()
        # SIGTERM to every process at once, then wait for each (SIGKILL after 10 s): one by one, the
        # shards' and coordinators' graceful stops added half a minute.
        procs = [r.proc for g in self.groups.values() for r in g.replicas if r.proc is not None]
        procs += [p for p in self.coord.procs if p is not None]
        for p in procs:
            if p.alive():
                p.signal(signal.SIGTERM)
        await asyncio.gather(*(asyncio.to_thread(p.stop, 10) for p in procs))
        await self.spy_server.stop(0)
        await self.spy.channel.close()
        self.provider_proc.stop()
        await asyncio.to_thread(self.coord.stop_all)
        if self.client is not None:
            await self.client.close()


async def start_spy(upstream: str) -> tuple[RecordingProvider, grpc.aio.Server, str]:
    spy = RecordingProvider(upstream)
    server, _health = new_server()
    provider_pb2_grpc.add_CapacityProviderServicer_to_server(spy, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return spy, server, f"127.0.0.1:{port}"


# --------------------------------------------------------------------------- invariants
def violations(spy: RecordingProvider, operators: Iterable[RoutedOperator],
               transfers: Iterable[coordinator_pb2.TransferStatus], stats: dict[str, int] | None = None) -> list[str]:
    """What the spy's record and the operators' records show went wrong (empty: nothing).

    1. Reclaim before drain: every Drain that reached the provider for a machine a shard had
       Configured for cluster C came after C's operator received a ReclaimInstruction naming the
       machine (its node name, or its id), since that Configure.
    2. One owner at a time: per machine, the shard id of OK lifecycle calls changes from X to Y only
       through a coordinator transfer from X to Y naming the machine (created before Y's first call),
       and X's last call was answered before Y's first call was made.
    """
    ops = {op.cluster_id: op for op in operators}
    names: dict[str, set[str]] = {}
    for op in ops.values():
        for mid, ns in op.node_names().items():
            names.setdefault(mid, set()).update(ns)
    out: list[str] = []
    st = stats if stats is not None else {}
    st.update(drains_checked=0, owner_changes_checked=0)
    calls = sorted(spy.calls, key=lambda c: c.t0)

    # 1. reclaim before drain
    for d in (c for c in calls if c.rpc == "Drain"):
        st["drains_checked"] += 1
        conf = [c for c in calls if c.rpc == "Configure" and c.ok and c.machine_id == d.machine_id and c.t0 < d.t0]
        if not conf:
            out.append(f"Drain of {d.machine_id} by {d.shard_id}@{d.epoch} with no Configure before it")
            continue
        last = conf[-1]
        op = ops.get(last.cluster)
        if op is None:
            out.append(f"Drain of {d.machine_id}: configured for unknown cluster {last.cluster!r}")
            continue
        ident = names.get(d.machine_id, set()) | {d.machine_id}
        told = [f for f in op.reclaims(since=last.t0) if f.at <= d.t0
                and ident & set(f.msg.reclaim_instruction.nodes)]
        if not told:
            out.append(f"Drain of {d.machine_id} ({last.cluster}) by {d.shard_id}@{d.epoch} at {d.t0:.2f} "
                       f"before its operator received a ReclaimInstruction naming it")

    # 2. one owner at a time
    moves: dict[str, list[tuple[str, str, float]]] = {}
    for t in transfers:
        if t.phase != "done":
            continue
        for mid in t.machine_ids:
            moves.setdefault(mid, []).append((t.from_shard_id, t.to_shard_id, t.created_at_unix_ns / 1e9))
    by_machine: dict[str, list[Call]] = {}
    for c in calls:
        if c.ok:
            by_machine.setdefault(c.machine_id, []).append(c)
    for mid, seq in by_machine.items():
        avail = sorted(moves.get(mid, []), key=lambda x: x[2])
        for prev, cur in pairwise(seq):
            if prev.shard_id == cur.shard_id:
                continue
            st["owner_changes_checked"] += 1
            tr = next((x for x in avail if x[0] == prev.shard_id and x[1] == cur.shard_id
                       and x[2] <= cur.wall + 0.5), None)
            if tr is None:
                out.append(f"{mid}: {prev.rpc} by {prev.shard_id}@{prev.epoch} then {cur.rpc} by "
                           f"{cur.shard_id}@{cur.epoch} with no transfer {prev.shard_id}->{cur.shard_id} between")
                continue
            avail.remove(tr)
            if prev.t1 > cur.t0:
                out.append(f"{mid}: {cur.shard_id}'s {cur.rpc} started before {prev.shard_id}'s {prev.rpc} was answered")
    return out


async def wait_all(*aws: Awaitable[Any]) -> list[Any]:
    return list(await asyncio.gather(*aws))
