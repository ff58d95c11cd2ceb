"""The conformance suite's wire client: only the six RPCs, no knowledge of the implementation.

Checks are written against this small vocabulary (pick a speculative machine,
walk it to IDLE, send a fenced call, wait until a state is reached) so each
reads like the rule it certifies. Every wait is a poll with a deadline.
"""

from __future__ import annotations

import builtins
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from bigfleet.provider.conformance.dialer import Transport
from bigfleet.v1alpha1 import provider_pb2 as pb
from bigfleet.v1alpha1 import provider_pb2_grpc as pbg

T = TypeVar("T")

S = pb.MACHINE_STATE_SPECULATIVE
CREATING = pb.MACHINE_STATE_CREATING
IDLE = pb.MACHINE_STATE_IDLE
CONFIGURING = pb.MACHINE_STATE_CONFIGURING
CONFIGURED = pb.MACHINE_STATE_CONFIGURED
DRAINING = pb.MACHINE_STATE_DRAINING
DELETING = pb.MACHINE_STATE_DELETING
FAILED = pb.MACHINE_STATE_FAILED

BLOB = b"# conformance\n"
OK = grpc.StatusCode.OK
FP = grpc.StatusCode.FAILED_PRECONDITION


def state_name(s: int) -> str:
    return str(pb.MachineState.Name(s)) if s in pb.MachineState.values() else str(s)  # type: ignore[arg-type,unused-ignore]


class CheckFailed(AssertionError):
    pass


class Skip(Exception):
    pass


def expect(cond: object, msg: str) -> None:
    if not cond:
        raise CheckFailed(msg)


@dataclass(frozen=True)
class Token:
    shard: str = ""
    epoch: int = 0
    seq: int = 0


ZERO = Token()
_counter = itertools.count(1)


def unique_shard(prefix: str) -> str:
    return f"conf-{prefix}-{time.time_ns()}-{next(_counter)}"


class ShardSession:
    """A well-behaved shard: one epoch, a sequence number drawn fresh for every call."""

    def __init__(self, prefix: str, epoch: int = 1) -> None:
        self.shard = unique_shard(prefix)
        self.epoch = epoch
        self.seq = 0

    def next(self) -> Token:
        self.seq += 1
        return Token(self.shard, self.epoch, self.seq)

    def new_epoch(self) -> None:
        self.epoch += 1
        self.seq = 0


class Harness:
    def __init__(self, target: str, call_timeout: float = 30.0, settle_timeout: float = 15.0,
                 transport: Transport | None = None) -> None:
        self.target = target
        self.call_timeout = call_timeout
        self.settle_timeout = settle_timeout
        self.dialer = (transport or Transport()).dialer(target)
        self.channel = self.dialer.channel()
        self.stub = pbg.CapacityProviderStub(self.channel)
        self._delete_supported: bool | None = None
        #: machines this run gave back with Delete: a Delete of one of them again is a replay of
        #: its latest transition (accepted by the contract), not an out-of-position call
        self.released: set[str] = set()

    def close(self) -> None:
        self.dialer.close()

    def second_connection(self) -> tuple[grpc.Channel, pbg.CapacityProviderStub]:
        ch = self.dialer.channel([("grpc.use_local_subchannel_pool", 1)])
        return ch, pbg.CapacityProviderStub(ch)

    def _stub(self, tok: Token, stub: Any) -> Any:
        """An explicit stub wins; else one that may act as the token's shard (mTLS), else the default."""
        return stub or self.dialer.stub_for_shard(tok.shard) or self.stub

    # ---- raw calls ---------------------------------------------------------------------------------

    def list(self, states: Sequence[int] = (), max_results: int = 0, since: bytes = b"",
             timeout: float | None = None) -> pb.MachineList:
        out: pb.MachineList = self.stub.List(
            pb.ListFilter(states=[pb.MachineState.ValueType(s) for s in states], max_results=max_results,
                          since_revision=since),
            timeout=timeout or max(self.call_timeout, 120.0))
        return out

    def get(self, mid: str) -> pb.Machine:
        out: pb.Machine = self.stub.Get(pb.MachineRef(id=mid), timeout=self.call_timeout)
        return out

    def state(self, mid: str) -> int:
        try:
            return int(self.get(mid).state)
        except grpc.RpcError:
            return pb.MACHINE_STATE_UNSPECIFIED

    def revision(self) -> bytes:
        return bytes(self.list().revision)

    def first(self, states: Sequence[int] = ()) -> pb.Machine:
        """``List(states, max_results=1)``'s machine; a provider answering none fails the check by name
        (the contract: a positive ``max_results`` returns at least one machine when any matches)."""
        got = self.list(states, max_results=1).machines
        where = ",".join(state_name(s) for s in states) or "any state"
        expect(got, f"List({where}, max_results=1) returned no machine")
        return got[0]

    def listed(self, mid: str, states: Sequence[int] = (), lst: pb.MachineList | None = None) -> pb.Machine:
        """``mid``'s record in ``lst`` (default: a fresh ``List(states)``). A machine the provider
        knows but leaves out of List is invisible to a shard's reconcile, so it fails by name."""
        lst = lst if lst is not None else self.list(states)
        found = next((m for m in lst.machines if m.id == mid), None)
        if found is None:
            where = ",".join(state_name(s) for s in states) or "unfiltered"
            raise CheckFailed(f"{mid} ({state_name(self.state(mid))} per Get) is missing from List ({where}, "
                              f"{len(lst.machines)} machines)")
        return found

    def create(self, mid: str, tok: Token = ZERO, stub: Any = None) -> pb.TransitionAck:
        out: pb.TransitionAck = self._stub(tok, stub).Create(
            pb.CreateRequest(machine_id=mid, shard_id=tok.shard, shard_epoch=tok.epoch, sequence_number=tok.seq),
            timeout=self.call_timeout)
        return out

    def configure(self, mid: str, cluster: str = "conf-cluster", md: dict[str, str] | None = None,
                  tok: Token = ZERO, blob: bytes = BLOB, stub: Any = None) -> pb.TransitionAck:
        out: pb.TransitionAck = self._stub(tok, stub).Configure(
            pb.ConfigureRequest(machine_id=mid, cluster_id=cluster, bootstrap_blob=blob, shard_id=tok.shard,
                                shard_epoch=tok.epoch, sequence_number=tok.seq, shard_metadata=md or {}),
            timeout=self.call_timeout)
        return out

    def drain(self, mid: str, grace: int = 0, tok: Token = ZERO, stub: Any = None) -> pb.TransitionAck:
        out: pb.TransitionAck = self._stub(tok, stub).Drain(
            pb.DrainRequest(machine_id=mid, grace_period_seconds=grace, shard_id=tok.shard, shard_epoch=tok.epoch,
                            sequence_number=tok.seq), timeout=self.call_timeout)
        return out

    def delete(self, mid: str, tok: Token = ZERO, stub: Any = None) -> pb.TransitionAck:
        out: pb.TransitionAck = self._stub(tok, stub).Delete(
            pb.DeleteRequest(machine_id=mid, shard_id=tok.shard, shard_epoch=tok.epoch, sequence_number=tok.seq),
            timeout=self.call_timeout)
        return out

    def call(self, rpc: str, mid: str, tok: Token = ZERO) -> pb.TransitionAck:
        """The standard fenced probe for each lifecycle RPC."""
        if rpc == "create":
            return self.create(mid, tok)
        if rpc == "configure":
            return self.configure(mid, tok=tok)
        if rpc == "drain":
            return self.drain(mid, tok=tok)
        return self.delete(mid, tok)

    @staticmethod
    def code(fn: Callable[..., Any], *args: Any, **kw: Any) -> grpc.StatusCode:
        """Run a call; answer its status code (OK on success)."""
        try:
            fn(*args, **kw)
        except grpc.RpcError as exc:
            code: grpc.StatusCode = exc.code()
            return code
        return OK

    # ---- waits and walks ---------------------------------------------------------------------------

    def must_reach(self, mid: str, state: int, timeout: float | None = None) -> pb.Machine:
        deadline = time.monotonic() + (timeout or self.settle_timeout)
        last = None
        while True:
            try:
                m = self.get(mid)
                if m.state == state:
                    return m
                last = m.state
            except grpc.RpcError:
                pass
            if time.monotonic() >= deadline:
                raise CheckFailed(f"{mid} never reached {state_name(state)} (last seen {state_name(last or 0)})")
            time.sleep(0.02)

    def stays_in(self, mid: str, state: int, window: float) -> None:
        deadline = time.monotonic() + window
        while time.monotonic() < deadline:
            s = self.state(mid)
            expect(s == state, f"{mid} left {state_name(state)} for {state_name(s)}")
            time.sleep(0.02)

    def pick_speculative(self, n: int = 1, unreleased: bool = False) -> builtins.list[str]:
        # Machines labelled for injected create faults are never picked for ordinary walks.
        ids = list(dict.fromkeys(
            m.id for m in self.list([S], max_results=n + 8 + (len(self.released) if unreleased else 0)).machines
            if m.labels.get("conformance.fault/create") != "error"
        ))
        if unreleased:
            ids = [i for i in ids if i not in self.released] or ids
        if len(ids) < n:
            raise Skip(f"needs {n} SPECULATIVE machine(s), provider has {len(ids)}")
        return ids[:n]

    def walk_to_idle(self) -> str:
        mid = self.pick_speculative()[0]
        self.create(mid)
        self.must_reach(mid, IDLE)
        return mid

    def walk_to_configured(self, cluster: str = "conf-cluster", md: dict[str, str] | None = None) -> str:
        mid = self.walk_to_idle()
        self.configure(mid, cluster, md)
        self.must_reach(mid, CONFIGURED)
        return mid

    def delete_supported(self) -> bool:
        """Probe once: UNIMPLEMENTED on an unknown id means the provider has no Delete."""
        if self._delete_supported is None:
            code = self.code(self.delete, f"conf-ghost-{time.time_ns()}")
            self._delete_supported = code != grpc.StatusCode.UNIMPLEMENTED
        return self._delete_supported

    def release(self, mid: str) -> None:
        """Best effort: give an IDLE machine back to the pool so later checks have slots."""
        if self.delete_supported() and self.state(mid) == IDLE and self.code(self.delete, mid) == OK:
            self.released.add(mid)
            self.must_reach(mid, S)


def fanout(n: int, fn: Callable[[int], T]) -> list[T | BaseException]:
    """Run fn(0..n-1) at the same time on n threads; exceptions are returned, not raised."""
    import threading

    results: list[T | BaseException] = [RuntimeError("not run")] * n
    barrier = threading.Barrier(n)

    def worker(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = fn(i)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def single_operation_id(results: Sequence[object]) -> str:
    oks = [r for r in results if isinstance(r, pb.TransitionAck)]
    expect(oks, f"no call succeeded: {[repr(r)[:120] for r in results[:3]]}")
    errs = [r for r in results if not isinstance(r, pb.TransitionAck)]
    expect(not errs, f"{len(errs)} of {len(results)} concurrent retries failed: {errs[0]!r:.200}" if errs else "")
    ids = {r.operation_id for r in oks}
    expect("" not in ids, "an ack carried an empty operation_id")
    expect(len(ids) == 1, f"concurrent retries got {len(ids)} distinct operation ids: {sorted(ids)[:5]}")
    return ids.pop()
