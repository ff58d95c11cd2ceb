"""Client side of the coordinator: leader-following RPCs, the shard heartbeat loop, lookups.

Static stability is the rule: nothing here may stop a shard or an operator
from working when the coordinator is down. The heartbeat loop logs and
retries; acks of a failed report are carried on the next one; instructions
run in the background in sequence order and never block the caller.

Shard integration (see docs/coordinator.md)::

    client = CoordinatorClient(["coord-0:7790", "coord-1:7790", "coord-2:7790"])
    loop = HeartbeatLoop(client, shard_id="shard-0", build_report=make_report,
                         handler=MyHandler(), interval=10.0, state_file=data_dir / "coordinator-client.json")
    task = asyncio.create_task(loop.run())
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from bigfleet.observability import get_logger
from bigfleet.rpc import insecure_channel
from bigfleet.v1alpha1 import coordinator_pb2 as pb
from bigfleet.v1alpha1 import coordinator_pb2_grpc as pbg

LEADER_METADATA_KEY = "bigfleet-leader"
RETRY_LATER_KEY = "bigfleet-retry-later"
# Set by a follower on a call it forwards to the leader (value: its node id); a call carrying it
# is never forwarded again (coordinator/forward.py).
FORWARDED_METADATA_KEY = "bigfleet-forwarded-by"
#: Metadata for a call only the replica it reaches may answer: a follower refuses it ("not
#: leader", with a hint) instead of forwarding it. For probes of which replica leads.
DIRECT_METADATA = ((FORWARDED_METADATA_KEY, "direct"),)
ACCEPTED = pb.InstructAck.OUTCOME_ACCEPTED
REJECTED_STALE = pb.InstructAck.OUTCOME_REJECTED_STALE
REJECTED_INVALID = pb.InstructAck.OUTCOME_REJECTED_INVALID
FAILED = pb.InstructAck.OUTCOME_FAILED


class CoordinatorUnavailable(Exception):
    """No coordinator replica answered as leader."""


class _NoLeader(Exception):
    def __init__(self, msg: str, answered: bool) -> None:
        super().__init__(msg)
        self.answered = answered  # some replica is up (said "not leader"): an election may be on


class UnsupportedInstruction(Exception):
    """Raised by a handler for an instruction kind it does not implement (acked REJECTED_INVALID)."""


#: how long a replica with others behind it may take to connect before the next is tried
CONNECT_WAIT = 2.0
_SETTLED = frozenset({grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.TRANSIENT_FAILURE,
                      grpc.ChannelConnectivity.SHUTDOWN})


def leader_hint(err: grpc.aio.AioRpcError) -> str:
    """The leader address a "not leader" refusal names: the ``bigfleet-leader`` trailer, else
    ``leader=HOST:PORT`` in the details ("" when it names none)."""
    for k, v in err.trailing_metadata() or ():
        if k == LEADER_METADATA_KEY and v:
            return str(v)
    msg = err.details() or ""
    if "leader=" in msg:
        return msg.split("leader=", 1)[1].split()[0].strip(";,")
    return ""


class CoordinatorClient:
    """Calls the leader among ``addresses``, following FAILED_PRECONDITION leader hints.

    A follower forwards most calls to the leader itself (coordinator/forward.py); where one
    refuses instead (ReportShard, its leader unreachable from it, an older release) the hinted
    address is tried next, and when it cannot be dialled from here, the remaining addresses.
    A channel per address is kept open; ``call`` tries the last known leader
    first, then every other address, and raises :class:`CoordinatorUnavailable`
    when none answered as leader. Errors other than "not leader"/unreachable
    (INVALID_ARGUMENT, NOT_FOUND, ...) are raised as they are.
    """

    def __init__(self, addresses: Sequence[str], timeout: float = 5.0, tls: Any = None) -> None:
        addrs = [a.strip() for a in addresses if a and a.strip()]
        if not addrs:
            raise ValueError("at least one coordinator address is required")
        self.addresses = addrs
        self.timeout = timeout
        # A bigfleet.security.tls.TLSConfig, or None for plaintext.
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._leader: str | None = None

    def _channel(self, addr: str) -> grpc.aio.Channel:
        ch = self._channels.get(addr)
        if ch is None:
            if self.tls is not None:
                from bigfleet.security.tls import dial

                ch = dial(addr, self.tls)
            else:
                ch = insecure_channel(addr)
            self._channels[addr] = ch
        return ch

    async def _ready(self, addr: str, timeout: float) -> bool:
        """Whether ``addr`` completes a connection within a short wait. A frozen replica (SIGSTOP,
        a hung host) accepts TCP but never speaks HTTP/2: calling it would spend the whole timeout
        before the next address is tried. Only asked while other addresses remain."""
        ch = self._channel(addr)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(CONNECT_WAIT, timeout / 2)
        state = ch.get_state(try_to_connect=True)
        # (a refused or unresolvable address is TRANSIENT_FAILURE at once: its call fails fast as before)
        while state not in _SETTLED:
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(ch.wait_for_state_change(state), left)
            except TimeoutError:
                return False
            state = ch.get_state(try_to_connect=True)
        return True

    def stub(self, addr: str) -> pbg.CoordinatorStub:
        return pbg.CoordinatorStub(self._channel(addr))

    @property
    def leader(self) -> str | None:
        return self._leader

    async def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        """Call the leader. While replicas answer but none is leader (an election, or a new
        leader still catching up) it retries for up to the timeout, so a failover looks like a
        slow call rather than an error; a "not leader" answer means nothing was executed."""
        budget = timeout or self.timeout
        deadline = asyncio.get_running_loop().time() + budget
        delay = 0.05
        while True:
            try:
                return await self._call_once(method, request, budget)
            except _NoLeader as exc:
                left = deadline - asyncio.get_running_loop().time()
                if not exc.answered or left <= delay:
                    raise CoordinatorUnavailable(str(exc)) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def _call_once(self, method: str, request: Any, timeout: float) -> Any:
        order = ([self._leader] if self._leader else []) + [a for a in self.addresses if a != self._leader]
        tried: set[str] = set()
        errors: list[str] = []
        answered = False
        while order:
            addr = order.pop(0)
            if addr in tried:
                continue
            tried.add(addr)
            if order and not await self._ready(addr, timeout):
                errors.append(f"{addr}: not answering")
                if self._leader == addr:
                    self._leader = None
                continue
            try:
                resp = await getattr(self.stub(addr), method)(request, timeout=timeout)
            except grpc.aio.AioRpcError as err:
                code = err.code()
                if code == grpc.StatusCode.FAILED_PRECONDITION and "not leader" in (err.details() or ""):
                    hint = leader_hint(err)
                    answered = True
                    errors.append(f"{addr}: not leader")
                    if hint and hint not in tried:
                        order.insert(0, hint)
                    continue
                retry_later = any(k == RETRY_LATER_KEY for k, _ in (err.trailing_metadata() or ()))
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not retry_later:
                    errors.append(f"{addr}: {code.name.lower()}")
                    if self._leader == addr:
                        self._leader = None
                    continue
                raise
            self._leader = addr
            return resp
        raise _NoLeader("no coordinator leader reachable (" + "; ".join(errors) + ")", answered)

    async def stream(self, method: str, request: Any) -> Any:
        """A server-streaming call on the leader (found with a cheap unary probe first)."""
        await self.call("ListShards", pb.ListShardsRequest())
        assert self._leader is not None
        return getattr(self.stub(self._leader), method)(request)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


async def lookup_cluster(
    addresses: Sequence[str], cluster_id: str, timeout: float = 5.0, tls: Any = None
) -> pb.LookupClusterResponse:
    """The shard serving ``cluster_id`` (binding it on first contact).

    Raises :class:`CoordinatorUnavailable` when no leader answers and
    ``grpc.aio.AioRpcError`` (UNAVAILABLE) while the cluster is being handed
    off; callers cache the last answer and keep using it meanwhile.
    """
    client = CoordinatorClient(addresses, timeout=timeout, tls=tls)
    try:
        resp: pb.LookupClusterResponse = await client.call("LookupCluster", pb.LookupClusterRequest(cluster_id=cluster_id))
        return resp
    finally:
        await client.close()


# --------------------------------------------------------------------------- shard side
class InstructionHandler(Protocol):
    """What a shard implements. Every method must be idempotent (an instruction
    can be redelivered after a restart) and may take as long as it needs (it
    runs in the background; the ack goes out on the next report after it returns).
    Raise :class:`UnsupportedInstruction` for kinds not implemented; any other
    exception is acked FAILED with the error text."""

    async def assign_domain(self, topology_key: str, topology_value: str) -> None: ...

    async def unassign_domain(self, topology_key: str, topology_value: str) -> None: ...

    async def release_cluster(self, msg: pb.ReleaseCluster) -> list[str]:
        """Stop deciding for the cluster, settle in-flight provider calls on its
        machines, close its Session, persist the release, forget the machines;
        return their ids."""
        ...

    async def adopt_cluster(self, msg: pb.AdoptCluster) -> None:
        """Take ownership of ``msg.machine_ids`` for ``msg.cluster_id`` and serve its Session from now on."""
        ...

    async def release_inventory(self, msg: pb.TransferOwnership) -> list[str]:
        """Donor side: choose idle, then speculative, machines matching the selector, release them, return ids."""
        ...

    async def adopt_inventory(self, msg: pb.TransferOwnership) -> None:
        """Recipient side: take ownership of ``msg.machine_ids``."""
        ...

    async def cross_shard_drain(self, msg: pb.CrossShardDrain) -> list[str]:
        """Drain machines of priority < preemptor_priority matching the selector; when idle, release and return ids."""
        ...

    async def reassign_speculative(self, msg: pb.ReassignSpeculative) -> None: ...


class BaseInstructionHandler:
    """Domain bookkeeping plus 'unsupported' for the rest; subclass what a shard implements."""

    def __init__(self) -> None:
        self.domains: set[tuple[str, str]] = set()

    async def assign_domain(self, topology_key: str, topology_value: str) -> None:
        self.domains.add((topology_key, topology_value))

    async def unassign_domain(self, topology_key: str, topology_value: str) -> None:
        self.domains.discard((topology_key, topology_value))

    async def release_cluster(self, msg: pb.ReleaseCluster) -> list[str]:
        raise UnsupportedInstruction("release_cluster")

    async def adopt_cluster(self, msg: pb.AdoptCluster) -> None:
        raise UnsupportedInstruction("adopt_cluster")

    async def release_inventory(self, msg: pb.TransferOwnership) -> list[str]:
        raise UnsupportedInstruction("transfer_ownership (release)")

    async def adopt_inventory(self, msg: pb.TransferOwnership) -> None:
        raise UnsupportedInstruction("transfer_ownership (adopt)")

    async def cross_shard_drain(self, msg: pb.CrossShardDrain) -> list[str]:
        raise UnsupportedInstruction("cross_shard_drain")

    async def reassign_speculative(self, msg: pb.ReassignSpeculative) -> None:
        raise UnsupportedInstruction("reassign_speculative")


@dataclass
class _Done:
    outcome: int
    reason: str
    machine_ids: list[str]


class InstructionGate:
    """Fencing and exactly-once bookkeeping (no I/O; the loop persists it).

    * ``coordinator_term`` high-water mark: a response below it is dropped
      whole (nothing run, nothing acked); an instruction below it is acked
      REJECTED_STALE; equal terms are accepted; a higher one raises the mark.
    * ``instruction_id`` is the exactly-once key: a redelivered id that ran
      already is re-acked with its first outcome (reason
      ``duplicate-redelivery``); one still running is skipped.
    * Acks wait in ``outbox`` until a report carrying them succeeds.
    """

    def __init__(self, keep: int = 4096) -> None:
        self.high_water = 0
        self.done: OrderedDict[str, _Done] = OrderedDict()
        self.running: set[str] = set()
        self.outbox: OrderedDict[str, pb.InstructAck] = OrderedDict()
        self.keep = keep

    def admit(self, ack: pb.ReportAck) -> list[pb.CoordinatorInstruction]:
        """Instructions to run now, in sequence order; stale/duplicate ones are acked directly."""
        if ack.coordinator_term < self.high_water:
            return []
        self.high_water = max(self.high_water, ack.coordinator_term)
        run: list[pb.CoordinatorInstruction] = []
        for ins in sorted(ack.instructions, key=lambda i: i.sequence_number):
            iid = ins.instruction_id
            if not iid:
                continue
            if ins.coordinator_term < self.high_water:
                self._queue(pb.InstructAck(instruction_id=iid, outcome=REJECTED_STALE, reason=f"term {ins.coordinator_term} < {self.high_water}"))
                continue
            if iid in self.running:
                continue
            prev = self.done.get(iid)
            if prev is not None:
                if iid not in self.outbox:
                    self._queue(
                        pb.InstructAck(instruction_id=iid, outcome=prev.outcome,  # type: ignore[arg-type]
                        reason=prev.reason or "duplicate-redelivery", machine_ids=prev.machine_ids)
                    )
                continue
            self.running.add(iid)
            run.append(ins)
        return run

    def finish(self, iid: str, outcome: int, reason: str = "", machine_ids: Sequence[str] = ()) -> None:
        self.running.discard(iid)
        self.done[iid] = _Done(outcome, reason, list(machine_ids))
        while len(self.done) > self.keep:
            self.done.popitem(last=False)
        self._queue(pb.InstructAck(instruction_id=iid, outcome=outcome, reason=reason, machine_ids=list(machine_ids)))  # type: ignore[arg-type]

    def _queue(self, a: pb.InstructAck) -> None:
        self.outbox[a.instruction_id] = a

    def take_acks(self) -> list[pb.InstructAck]:
        return list(self.outbox.values())

    def delivered(self, acks: Sequence[pb.InstructAck]) -> None:
        for a in acks:
            cur = self.outbox.get(a.instruction_id)
            if cur is not None and cur == a:
                del self.outbox[a.instruction_id]

    # Persistence, so a restarted shard neither re-runs a finished release nor forgets its mark.
    def to_json(self) -> dict[str, Any]:
        return {
            "high_water": self.high_water,
            "done": [[k, v.outcome, v.reason, v.machine_ids] for k, v in self.done.items()],
        }

    def load_json(self, data: dict[str, Any]) -> None:
        self.high_water = int(data.get("high_water", 0))
        for k, outcome, reason, mids in data.get("done", []):
            self.done[str(k)] = _Done(int(outcome), str(reason), [str(m) for m in mids])


ReportBuilder = Callable[[], "pb.ShardReport | Awaitable[pb.ShardReport]"]


class HeartbeatLoop:
    """Reports every ``interval`` seconds; runs instructions; never raises out of :meth:`run`."""

    def __init__(
        self,
        client: CoordinatorClient,
        shard_id: str,
        build_report: ReportBuilder,
        handler: InstructionHandler,
        interval: float = 10.0,
        shard_address: str = "",
        shard_epoch: int = 0,
        state_file: Path | None = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.client = client
        self.shard_id = shard_id
        self.build_report = build_report
        self.handler = handler
        self.interval = interval
        self.shard_address = shard_address
        self.shard_epoch = shard_epoch
        self.state_file = state_file
        self.clock = clock
        self.gate = InstructionGate()
        self.cycle = 0
        self.reports_ok = 0
        self.reports_failed = 0
        self.last_error = ""
        self.log = get_logger("coordinator-client", shard=shard_id)
        self._kick = asyncio.Event()
        self._work: asyncio.Queue[pb.CoordinatorInstruction] = asyncio.Queue()
        self._worker: asyncio.Task[None] | None = None
        if state_file is not None and state_file.exists():
            try:
                self.gate.load_json(json.loads(state_file.read_text()))
            except (OSError, ValueError) as exc:
                self.log.warning("coordinator client state unreadable; starting fresh", error=str(exc))

    def kick(self) -> None:
        """Report now (e.g. after an instruction finished) instead of waiting for the interval."""
        self._kick.set()

    async def run(self) -> None:
        self._worker = asyncio.create_task(self._run_instructions())
        backoff = min(1.0, self.interval)
        try:
            while True:
                try:
                    ok = await self.report_once()
                except Exception as exc:  # nothing (not even a broken log sink) may stop the loop
                    self.last_error = repr(exc)
                    ok = False
                if ok:
                    backoff = min(1.0, self.interval)
                    wait = self.interval
                else:
                    wait = min(backoff, self.interval)
                    backoff = min(backoff * 2, max(self.interval, 1.0))
                self._kick.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._kick.wait(), wait)
        finally:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker

    async def report_once(self) -> bool:
        try:
            built = self.build_report()
            report = await built if inspect.isawaitable(built) else built
        except Exception as exc:
            self.log.warning("building the coordinator report failed", error=repr(exc))
            report = pb.ShardReport()
        self.cycle += 1
        report.shard_id = self.shard_id
        report.cycle = self.cycle
        report.timestamp_unix_nanos = self.clock()
        report.shard_epoch = report.shard_epoch or self.shard_epoch
        if self.shard_address and not report.shard_address:
            report.shard_address = self.shard_address
        acks = self.gate.take_acks()
        del report.instruction_acks[:]
        report.instruction_acks.extend(acks)
        try:
            resp: pb.ReportAck = await self.client.call("ReportShard", report)
        except Exception as exc:  # the coordinator being down must never hurt the shard
            self.reports_failed += 1
            self.last_error = str(exc)
            self.log.info("coordinator report failed; will retry", error=str(exc)[:300], acks_requeued=len(acks))
            return False
        self.reports_ok += 1
        self.gate.delivered(acks)
        for ins in self.gate.admit(resp):
            self._work.put_nowait(ins)
        if self.gate.outbox and not acks:
            self.kick()  # stale/duplicate acks produced by admit go out promptly
        self._persist()
        return True

    async def _run_instructions(self) -> None:
        """One at a time in sequence order, except cross-shard drains: they wait for
        machines to drain (minutes) and must not hold up a handoff or a domain change."""
        side: set[asyncio.Task[None]] = set()
        try:
            while True:
                ins = await self._work.get()
                if ins.WhichOneof("payload") == "cross_shard_drain":
                    task = asyncio.create_task(self._run_one(ins))
                    side.add(task)
                    task.add_done_callback(side.discard)
                else:
                    await self._run_one(ins)
        finally:
            for t in side:
                t.cancel()

    async def _run_one(self, ins: pb.CoordinatorInstruction) -> None:
        outcome, reason, mids = await self._dispatch(ins)
        self.gate.finish(ins.instruction_id, outcome, reason, mids)
        self.kick()
        self._persist()
        name = pb.InstructAck.Outcome.Name(outcome)  # type: ignore[arg-type]
        with contextlib.suppress(Exception):
            self.log.info("instruction done", id=ins.instruction_id, kind=ins.WhichOneof("payload"), outcome=name, reason=reason)

    async def _dispatch(self, ins: pb.CoordinatorInstruction) -> tuple[int, str, list[str]]:
        kind = ins.WhichOneof("payload")
        h = self.handler
        try:
            mids: list[str] = []
            if kind == "assign_domain":
                await h.assign_domain(ins.assign_domain.topology_key, ins.assign_domain.topology_value)
            elif kind == "unassign_domain":
                await h.unassign_domain(ins.unassign_domain.topology_key, ins.unassign_domain.topology_value)
            elif kind == "release_cluster":
                mids = list(await h.release_cluster(ins.release_cluster))
            elif kind == "adopt_cluster":
                await h.adopt_cluster(ins.adopt_cluster)
            elif kind == "transfer_ownership":
                t = ins.transfer_ownership
                if t.from_shard_id == self.shard_id and not t.machine_ids:
                    mids = list(await h.release_inventory(t))
                elif t.to_shard_id == self.shard_id:
                    await h.adopt_inventory(t)
                else:
                    return REJECTED_INVALID, "transfer names neither side as this shard", []
            elif kind == "cross_shard_drain":
                mids = list(await h.cross_shard_drain(ins.cross_shard_drain))
            elif kind == "reassign_speculative":
                await h.reassign_speculative(ins.reassign_speculative)
            else:
                return REJECTED_INVALID, f"unknown instruction payload {kind!r}", []
        except UnsupportedInstruction as exc:
            return REJECTED_INVALID, f"unsupported: {exc}", []
        except Exception as exc:
            return FAILED, f"{type(exc).__name__}: {exc}"[:500], []
        return ACCEPTED, "", mids

    def _persist(self) -> None:
        if self.state_file is None:
            return
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        try:
            tmp.write_text(json.dumps(self.gate.to_json()))
            os.replace(tmp, self.state_file)
        except OSError as exc:
            self.log.warning("cannot persist coordinator client state", error=str(exc))
