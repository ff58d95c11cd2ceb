"""The conformance checks, one function per rule of the provider contract.

Every check is registered with a lane and a stable id (C… core, F… fault,
D… durability, S… scale) and takes a ``Ctx``. A check passes by returning,
fails by raising ``CheckFailed`` (or any unexpected error) and skips by
raising ``Skip`` with the reason.
"""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from bigfleet.provider.conformance.harness import (
    CONFIGURED,
    CONFIGURING,
    CREATING,
    DELETING,
    DRAINING,
    FAILED,
    FP,
    IDLE,
    OK,
    ZERO,
    CheckFailed,
    Harness,
    S,
    ShardSession,
    Skip,
    Token,
    expect,
    fanout,
    single_operation_id,
    state_name,
    unique_shard,
)
from bigfleet.v1alpha1 import provider_pb2 as pb


@dataclass
class Ctx:
    h: Harness
    params: dict[str, Any] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    lane: str
    id: str
    title: str
    fn: Callable[[Ctx], None]


REGISTRY: list[Check] = []


def check(lane: str, cid: str, title: str) -> Callable[[Callable[[Ctx], None]], Callable[[Ctx], None]]:
    def deco(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        if any(c.id == cid for c in REGISTRY):
            raise ValueError(f"duplicate check id {cid}")
        REGISTRY.append(Check(lane, cid, title, fn))
        return fn

    return deco


def checks_for(lane: str) -> list[Check]:
    return [c for c in REGISTRY if c.lane == lane]


def non_fencing_rejection(code: grpc.StatusCode, what: str) -> None:
    expect(code != OK, f"{what}: was accepted, must be rejected")
    expect(code != FP, f"{what}: rejected with FAILED_PRECONDITION, which is reserved for fencing")


_FORBIDDEN_LABELS = {"instance-type", "instance_type", "instanceType", "zone", "availability-zone",
                     "availability_zone", "capacity-type", "capacity_type", "capacityType"}
_QTY = re.compile(r"[+]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[kMGTPE]i?|[mun])?")


def _qty(v: str) -> float | None:
    m = _QTY.fullmatch(v)
    if not m:
        return None
    return float(m.group(1))


_TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def shape_problems(m: pb.Machine, strict_everywhere: bool = False) -> list[str]:
    """Field-shape rules every machine record must follow (R-SHAPE)."""
    p: list[str] = []
    who = m.id or "<no id>"
    if not m.id:
        p.append("empty id")
    if m.state not in pb.MachineState.values() or m.state == pb.MACHINE_STATE_UNSPECIFIED:
        p.append(f"{who}: state {m.state} is not a valid state")
    if not m.instance_type:
        p.append(f"{who}: empty instance_type")
    bad = _FORBIDDEN_LABELS.intersection(m.labels)
    if bad:
        p.append(f"{who}: labels duplicate top-level fields {sorted(bad)}")
    if not math.isfinite(m.price_per_hour) or m.price_per_hour < 0:
        p.append(f"{who}: price_per_hour {m.price_per_hour} not finite and >= 0")
    q = m.interruption_probability
    if not (math.isfinite(q) and 0.0 <= q <= 1.0):
        p.append(f"{who}: interruption_probability {q} not in [0,1]")
    if m.capacity_type == pb.CAPACITY_TYPE_SPOT and not q > 0:
        p.append(f"{who}: SPOT machine with interruption_probability {q}")
    has_host = m.HasField("host") and bool(m.host.provider or m.host.ref)
    if m.state == S and has_host:
        p.append(f"{who}: SPECULATIVE machine has a host")
    if m.state in (IDLE, CONFIGURED) and not has_host:
        p.append(f"{who}: {state_name(m.state)} machine has no host")
    if m.state in (S, IDLE) and m.cluster:
        p.append(f"{who}: {state_name(m.state)} machine has cluster {m.cluster!r}")
    if m.state in (S, IDLE) and m.shard_metadata:
        p.append(f"{who}: {state_name(m.state)} machine still carries shard_metadata")
    if m.state in (CONFIGURING, CONFIGURED, DRAINING) and not m.cluster:
        p.append(f"{who}: {state_name(m.state)} machine has no cluster")
    if (has_host and m.state in (IDLE, CONFIGURED)) or strict_everywhere:
        if m.capacity_type == pb.CAPACITY_TYPE_UNSPECIFIED:
            p.append(f"{who}: capacity_type unset")
        if not m.zone:
            p.append(f"{who}: empty zone")
    if m.state == FAILED and not m.last_error:
        p.append(f"{who}: FAILED without last_error")
    for t in m.taints:  # optional (Python addition); when declared they must be valid Kubernetes taints
        if not t.key or t.effect not in _TAINT_EFFECTS:
            p.append(f"{who}: taint {t.key!r}={t.value!r}:{t.effect!r} needs a key and a valid effect")
    res, alloc = dict(m.resources.resources), dict(m.allocatable.resources)
    for k in set(res) & set(alloc):
        r, a = _qty(res[k]), _qty(alloc[k])
        if r is None or a is None:
            p.append(f"{who}: resource {k} does not parse as a quantity ({res[k]!r}/{alloc[k]!r})")
        elif not (r > 0 and a >= 0):
            p.append(f"{who}: resource {k}: request {res[k]} / allocatable {alloc[k]} out of range")
    return p


def expect_shape(m: pb.Machine, strict: bool = False) -> None:
    probs = shape_problems(m, strict)
    expect(not probs, "; ".join(probs[:5]))


# ==================================================================================================
# core: lifecycle and the transition matrix
# ==================================================================================================


@check("core", "C101", "full lifecycle SPECULATIVE→IDLE→CONFIGURED→IDLE(→SPECULATIVE)")
def lifecycle(c: Ctx) -> None:
    h = c.h
    mid = h.pick_speculative()[0]
    ack = h.create(mid)
    expect(ack.operation_id, "Create ack has an empty operation_id")
    expect(ack.machine.id == mid, "Create ack snapshot is for another machine")
    expect(ack.machine.state in (CREATING, IDLE), f"Create ack snapshot is {state_name(ack.machine.state)}")
    m = h.must_reach(mid, IDLE)
    expect_shape(m)
    host = (m.host.provider, m.host.ref)
    ack = h.configure(mid, "conf-cluster-life", {"k": "v"})
    expect(ack.machine.state in (CONFIGURING, CONFIGURED), f"Configure ack is {state_name(ack.machine.state)}")
    expect(ack.machine.cluster == "conf-cluster-life", "Configure ack snapshot lacks the binding")
    m = h.must_reach(mid, CONFIGURED)
    expect_shape(m)
    expect(m.cluster == "conf-cluster-life", f"CONFIGURED machine has cluster {m.cluster!r}")
    expect(m.host.provider == host[0], "host.provider changed between IDLE and CONFIGURED")
    ack = h.drain(mid, 0)
    expect(ack.machine.state in (DRAINING, IDLE), f"Drain ack is {state_name(ack.machine.state)}")
    m = h.must_reach(mid, IDLE)
    expect_shape(m)
    expect(m.cluster == "" and not m.shard_metadata, "binding not cleared after Drain")
    expect(m.host.provider == host[0], "host.provider changed across Configure/Drain")
    if h.delete_supported():
        ack = h.delete(mid)
        h.released.add(mid)
        expect(ack.machine.state in (DELETING, S), f"Delete ack is {state_name(ack.machine.state)}")
        m = h.must_reach(mid, S)
        expect_shape(m)


@check("core", "C102", "empty machine id → INVALID_ARGUMENT on every RPC")
def empty_ids(c: Ctx) -> None:
    h = c.h
    for name, fn in (("Create", lambda: h.create("")), ("Configure", lambda: h.configure("")),
                     ("Drain", lambda: h.drain("")), ("Get", lambda: h.get(""))):
        code = h.code(fn)
        expect(code == grpc.StatusCode.INVALID_ARGUMENT, f"{name} with empty id answered {code.name}")
    code = h.code(h.delete, "")
    expect(code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED),
           f"Delete with empty id answered {code.name}")


@check("core", "C103", "unknown machine → NOT_FOUND (Get and every mutation)")
def unknown_ids(c: Ctx) -> None:
    h = c.h
    ghost = f"conf-ghost-{time.time_ns()}"
    for rpc in ("create", "configure", "drain", "delete"):
        code = h.code(h.call, rpc, ghost)
        if rpc == "delete" and code == grpc.StatusCode.UNIMPLEMENTED:
            continue
        expect(code == grpc.StatusCode.NOT_FOUND, f"{rpc} on an unknown id answered {code.name}")
    code = h.code(h.get, ghost)
    expect(code == grpc.StatusCode.NOT_FOUND, f"Get on an unknown id answered {code.name}")


def _unchanged(h: Harness, mid: str, before: pb.Machine, what: str) -> None:
    after = h.get(mid)
    expect(after.state == before.state, f"{what}: state moved {state_name(before.state)}→{state_name(after.state)}")
    expect(after.cluster == before.cluster, f"{what}: binding changed")
    expect(dict(after.shard_metadata) == dict(before.shard_metadata), f"{what}: shard_metadata changed")


@check("core", "C104", "out-of-position calls are rejected (not FAILED_PRECONDITION) and change nothing")
def transition_matrix(c: Ctx) -> None:
    h = c.h
    spec = h.pick_speculative(unreleased=True)[0]  # (a Delete of one given back is a legal replay)
    before = h.get(spec)
    for rpc in ("configure", "drain", "delete"):
        code = h.code(h.call, rpc, spec)
        if rpc == "delete" and code == grpc.StatusCode.UNIMPLEMENTED:
            continue
        non_fencing_rejection(code, f"{rpc} on SPECULATIVE")
        _unchanged(h, spec, before, f"{rpc} on SPECULATIVE")
    idle = h.walk_to_idle()
    before = h.get(idle)
    non_fencing_rejection(h.code(h.drain, idle), "Drain on IDLE")
    _unchanged(h, idle, before, "Drain on IDLE")
    h.configure(idle, "conf-matrix")
    h.must_reach(idle, CONFIGURED)
    before = h.get(idle)
    non_fencing_rejection(h.code(h.create, idle), "Create on CONFIGURED")
    _unchanged(h, idle, before, "Create on CONFIGURED")
    code = h.code(h.delete, idle)
    if code != grpc.StatusCode.UNIMPLEMENTED:
        non_fencing_rejection(code, "Delete on CONFIGURED")
    _unchanged(h, idle, before, "Delete on CONFIGURED")
    code = h.code(h.configure, idle, "conf-someone-else")
    non_fencing_rejection(code, "Configure of a CONFIGURED machine to another cluster")
    _unchanged(h, idle, before, "Configure to another cluster")
    h.drain(idle)
    h.must_reach(idle, IDLE)
    h.release(idle)


@check("core", "C105", "settled machines do not drift on their own")
def no_drift(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_configured("conf-drift")
    h.stays_in(mid, CONFIGURED, 0.3)
    h.drain(mid)
    h.must_reach(mid, IDLE)
    h.stays_in(mid, IDLE, 0.3)
    h.release(mid)


@check("core", "C106", "only the in-flight edge's transitional state is ever observed")
def state_trace(c: Ctx) -> None:
    h = c.h
    mid = h.pick_speculative()[0]
    allowed = {S, CREATING, IDLE}
    h.create(mid)
    seen = _trace(h, mid, IDLE)
    expect(set(seen) <= allowed, f"Create showed {[state_name(s) for s in seen]}")
    h.configure(mid, "conf-trace")
    seen = _trace(h, mid, CONFIGURED)
    expect(set(seen) <= {IDLE, CONFIGURING, CONFIGURED}, f"Configure showed {[state_name(s) for s in seen]}")
    h.drain(mid)
    seen = _trace(h, mid, IDLE)
    expect(set(seen) <= {CONFIGURED, DRAINING, IDLE}, f"Drain showed {[state_name(s) for s in seen]}")
    h.release(mid)


def _trace(h: Harness, mid: str, until: int) -> list[int]:
    seen: list[int] = []
    deadline = time.monotonic() + h.settle_timeout
    while time.monotonic() < deadline:
        s = h.state(mid)
        if not seen or seen[-1] != s:
            seen.append(s)
        if s == until:
            return seen
        time.sleep(0.001)
    raise CheckFailed(f"{mid} never reached {state_name(until)}; saw {[state_name(s) for s in seen]}")


@check("core", "C107", "Delete is supported (returns to SPECULATIVE) or UNIMPLEMENTED for every call")
def delete_capability(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    code = h.code(h.delete, mid)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        for target in (mid, f"conf-ghost-{time.time_ns()}"):
            code = h.code(h.delete, target, Token(unique_shard("del"), 1, 1))
            expect(code == grpc.StatusCode.UNIMPLEMENTED, f"Delete answered {code.name} after UNIMPLEMENTED")
        return
    expect(code == OK, f"Delete on IDLE answered {code.name}")
    m = h.must_reach(mid, S)
    expect(not (m.host.provider or m.host.ref), "SPECULATIVE after Delete still has a host")


@check("core", "C108", "drain grace period: zero and long graces are accepted")
def drain_grace(c: Ctx) -> None:
    h = c.h
    for grace in (0, 3600):
        mid = h.walk_to_configured("conf-grace")
        ack = h.drain(mid, grace)
        expect(ack.operation_id, "Drain ack without operation_id")
        h.must_reach(mid, IDLE)
        h.release(mid)


# ==================================================================================================
# core: fencing
# ==================================================================================================


@check("core", "C201", "stale or equal token → FAILED_PRECONDITION; strictly newer passes")
def fence_stale(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    shard = unique_shard("stale")
    expect(h.code(h.create, mid, Token(shard, 5, 10)) == OK, "first contact (5,10) was not accepted")
    for e, s in ((5, 10), (5, 9), (4, 99), (0, 0), (-1, 1000)):
        code = h.code(h.create, mid, Token(shard, e, s))
        expect(code == FP, f"token ({e},{s}) after (5,10) answered {code.name}, want FAILED_PRECONDITION")
    expect(h.code(h.create, mid, Token(shard, 5, 11)) == OK, "(5,11) after (5,10) was not accepted")
    expect(h.code(h.create, mid, Token(shard, 6, 1)) == OK, "a higher epoch did not reset the sequence space")
    expect(h.code(h.create, mid, Token(shard, 6, 1)) == FP, "replaying (6,1) was not fenced")
    h.release(mid)


@check("core", "C202", "fencing applies to every mutating RPC, before position checks")
def fence_every_rpc(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_configured("conf-fence-all")
    sess = ShardSession("all")
    expect(h.code(h.call, "drain", mid, Token(sess.shard, 1, 100)) == OK, "fenced Drain with a fresh token failed")
    h.must_reach(mid, IDLE)
    for rpc in ("create", "configure", "drain", "delete"):
        code = h.code(h.call, rpc, mid, Token(sess.shard, 1, 50))
        expect(code == FP, f"stale {rpc} answered {code.name}, want FAILED_PRECONDITION")
    expect(h.state(mid) == IDLE, "a fenced call changed the machine")
    h.release(mid)


@check("core", "C203", "marks are per (shard, machine): other machines and other shards are independent")
def fence_scoping(c: Ctx) -> None:
    h = c.h
    a, b = h.pick_speculative(2)
    shard = unique_shard("scope")
    expect(h.code(h.create, a, Token(shard, 9, 9)) == OK, "first token on machine A refused")
    expect(h.code(h.create, b, Token(shard, 1, 1)) == OK, "a lower token on a different machine was fenced")
    other = unique_shard("scope-other")
    expect(h.code(h.create, a, Token(other, 1, 1)) == OK, "another shard's first token was fenced")
    h.must_reach(a, IDLE)
    h.must_reach(b, IDLE)
    h.release(a)
    h.release(b)


@check("core", "C204", "fence runs before NOT_FOUND; a passing token advances even when the call fails")
def fence_order(c: Ctx) -> None:
    h = c.h
    ghost = f"conf-ghost-{time.time_ns()}"
    shard = unique_shard("order")
    code = h.code(h.create, ghost, Token(shard, 1, 1))
    expect(code == grpc.StatusCode.NOT_FOUND, f"fresh token on unknown id answered {code.name}")
    code = h.code(h.create, ghost, Token(shard, 1, 1))
    expect(code == FP, f"replayed token on unknown id answered {code.name}, want FAILED_PRECONDITION")
    mid = h.walk_to_idle()
    code = h.code(h.drain, mid, 0, Token(shard, 1, 5))
    non_fencing_rejection(code, "Drain on IDLE")
    code = h.code(h.create, mid, Token(shard, 1, 4))
    expect(code == FP, f"token (1,4) after a rejected (1,5) answered {code.name}: mark did not advance")
    expect(h.code(h.create, mid, Token(shard, 1, 6)) == OK, "(1,6) refused")
    h.release(mid)


@check("core", "C205", "zero token bypasses fencing; non-zero tokens with empty parts are real tokens")
def fence_zero(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    for _ in range(3):
        expect(h.code(h.create, mid, ZERO) == OK, "zero-token retry was refused")
    expect(h.code(h.create, mid, Token("", 1, 1)) == OK, "token ('',1,1) first contact refused")
    expect(h.code(h.create, mid, Token("", 1, 1)) == FP, "token ('',1,1) replay was not fenced")
    shard = unique_shard("zero-nums")
    expect(h.code(h.create, mid, Token(shard, 0, 0)) == OK, "token (shard,0,0) first contact refused")
    expect(h.code(h.create, mid, Token(shard, 0, 0)) == FP, "token (shard,0,0) replay was not fenced")
    h.release(mid)


@check("core", "C206", "int64 extremes compare without overflow")
def fence_int64(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    shard = unique_shard("max")
    big = (1 << 63) - 1
    expect(h.code(h.create, mid, Token(shard, big, big - 1)) == OK, "(max,max-1) refused")
    expect(h.code(h.create, mid, Token(shard, big, big)) == OK, "(max,max) refused")
    expect(h.code(h.create, mid, Token(shard, big, big)) == FP, "(max,max) replay not fenced")
    expect(h.code(h.create, mid, Token(shard, big - 1, big)) == FP, "(max-1,max) after (max,max) not fenced")
    h.release(mid)


@check("core", "C207", "a new epoch fences the old one (zombie shard)")
def fence_zombie(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    old = ShardSession("zombie", epoch=1)
    new = ShardSession("zombie")
    new.shard, new.epoch = old.shard, 2
    expect(h.code(h.create, mid, old.next()) == OK, "epoch-1 call refused")
    expect(h.code(h.create, mid, new.next()) == OK, "epoch-2 call refused")
    for _ in range(3):
        code = h.code(h.call, "configure", mid, old.next())
        expect(code == FP, f"epoch-1 call after epoch 2 answered {code.name}")
    expect(h.state(mid) == IDLE, "a zombie call changed the machine")
    h.release(mid)


@check("core", "C208", "reads are never fenced")
def reads_unfenced(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    shard = unique_shard("reads")
    h.create(mid, Token(shard, 9, 9))
    for _ in range(3):
        h.get(mid)
        h.list([IDLE], max_results=5)
    h.release(mid)


# ==================================================================================================
# core: idempotency and concurrency
# ==================================================================================================


@check("core", "C301", "serial retries return the same operation id; new transitions get new ids")
def idem_serial(c: Ctx) -> None:
    h = c.h
    mid = h.pick_speculative()[0]
    ids = set()
    a1 = h.create(mid)
    a2 = h.create(mid)
    expect(a1.operation_id == a2.operation_id, "Create retry got a different operation id")
    h.must_reach(mid, IDLE)
    a3 = h.create(mid)
    expect(a3.operation_id == a1.operation_id, "Create retry after IDLE got a different operation id")
    ids.add(a1.operation_id)
    c1 = h.configure(mid, "conf-idem")
    expect(c1.operation_id not in ids, "Configure reused the Create operation id")
    h.must_reach(mid, CONFIGURED)
    c2 = h.configure(mid, "conf-idem")
    expect(c2.operation_id == c1.operation_id, "Configure retry after CONFIGURED got a new id")
    expect(c2.machine.state == CONFIGURED, f"idempotent ack shows {state_name(c2.machine.state)}, want current")
    ids.add(c1.operation_id)
    d1 = h.drain(mid)
    h.must_reach(mid, IDLE)
    expect(d1.operation_id not in ids, "Drain reused an earlier operation id")
    ids.add(d1.operation_id)
    c3 = h.configure(mid, "conf-idem")
    expect(c3.operation_id not in ids, "a second Configure cycle reused an operation id")
    h.must_reach(mid, CONFIGURED)
    h.drain(mid)
    h.must_reach(mid, IDLE)
    h.release(mid)


@check("core", "C302", "16 concurrent identical Creates: one operation id, one transition")
def idem_concurrent_create(c: Ctx) -> None:
    h = c.h
    mid = h.pick_speculative()[0]
    results = fanout(16, lambda i: h.create(mid))
    single_operation_id(results)
    h.must_reach(mid, IDLE)
    h.release(mid)


@check("core", "C303", "16 concurrent identical Configures over two connections: one operation id")
def idem_concurrent_configure(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    ch, stub2 = h.second_connection()
    try:
        results = fanout(16, lambda i: h.configure(mid, "conf-burst", {"i": "same"}, stub=stub2 if i % 2 else None))
    finally:
        ch.close()
    single_operation_id(results)
    m = h.must_reach(mid, CONFIGURED)
    expect(m.cluster == "conf-burst", "binding lost in the burst")
    h.drain(mid)
    h.must_reach(mid, IDLE)
    h.release(mid)


@check("core", "C304", "32 concurrent calls are served (8 distinct Creates + 24 reads)")
def concurrency(c: Ctx) -> None:
    h = c.h
    ids = h.pick_speculative(8)

    def call(i: int) -> object:
        if i < 8:
            return h.create(ids[i])
        if i % 2:
            return h.get(ids[i % 8])
        return h.list([S, CREATING, IDLE], max_results=4)

    results = fanout(32, call)
    errs = [r for r in results if isinstance(r, BaseException)]
    expect(not errs, f"{len(errs)} of 32 concurrent calls failed, first: {errs[0]!r:.200}" if errs else "")
    ops = {r.operation_id for r in results[:8] if isinstance(r, pb.TransitionAck)}
    expect(len(ops) == 8, f"8 Creates on distinct machines produced {len(ops)} distinct operation ids")
    for mid in ids:
        h.must_reach(mid, IDLE)
    for mid in ids:
        h.release(mid)


@check("core", "C305", "concurrent fenced calls from one shard: exactly the strictly newer tokens pass")
def fence_concurrent(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    shard = unique_shard("race")
    results = fanout(16, lambda i: h.create(mid, Token(shard, 1, 7)))
    oks = sum(1 for r in results if isinstance(r, pb.TransitionAck))
    fps = sum(1 for r in results if isinstance(r, grpc.RpcError) and r.code() == FP)
    expect(oks == 1 and fps == 15, f"16 racing copies of one token: {oks} accepted, {fps} fenced (want 1 and 15)")
    h.release(mid)


# ==================================================================================================
# core: shard_metadata store-and-echo
# ==================================================================================================

_NASTY = {
    "bigfleet.lucy.sh/assigned-priority": "1000",
    "bigfleet.lucy.sh/assigned-interruption-penalty-dollars": "0.5",
    "empty": "",
    "nul": "a\x00b",
    "control": "\x01\x1f\x7f",
    "c1": "\u0085\u009f",
    "unicode": "✓ 日本語 🚀",
    "key\x00with-nul": "v",
    "": "empty key",
}


@check("core", "C401", "shard_metadata echoed byte-for-byte through CONFIGURING→CONFIGURED→DRAINING, then cleared")
def metadata_echo(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    ack = h.configure(mid, "conf-meta", dict(_NASTY))
    expect(dict(ack.machine.shard_metadata) == _NASTY, "Configure ack does not echo shard_metadata verbatim")
    for m in (h.get(mid), *[x for x in h.list().machines if x.id == mid]):
        if m.state in (CONFIGURING, CONFIGURED):
            expect(dict(m.shard_metadata) == _NASTY, "Get/List during CONFIGURING does not echo verbatim")
    m = h.must_reach(mid, CONFIGURED)
    expect(dict(m.shard_metadata) == _NASTY, "CONFIGURED machine does not echo shard_metadata verbatim")
    expect(dict(h.listed(mid, [CONFIGURED]).shard_metadata) == _NASTY, "List does not echo shard_metadata verbatim")
    ack = h.drain(mid)
    if ack.machine.state == DRAINING:
        expect(dict(ack.machine.shard_metadata) == _NASTY, "DRAINING snapshot lost shard_metadata")
        expect(ack.machine.cluster == "conf-meta", "DRAINING snapshot lost the cluster")
    m = h.must_reach(mid, IDLE)
    expect(not m.shard_metadata and not m.cluster, "binding and metadata not cleared after Drain")
    ack = h.configure(mid, "conf-meta-2", {"only": "this"})
    expect(dict(ack.machine.shard_metadata) == {"only": "this"}, "a fresh Configure did not replace the metadata")
    h.must_reach(mid, CONFIGURED)
    h.drain(mid)
    h.must_reach(mid, IDLE)
    h.release(mid)


@check("core", "C402", "large requests: 2 MiB metadata echoed or INVALID_ARGUMENT")
def large_requests(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    md = {f"k{i:04d}": "x" * 2048 for i in range(1024)}
    try:
        ack = h.configure(mid, "conf-big", md)
    except grpc.RpcError as exc:
        expect(exc.code() == grpc.StatusCode.INVALID_ARGUMENT, f"2 MiB metadata answered {exc.code().name}")
        _unchanged(h, mid, h.get(mid), "refused oversize metadata")
        expect(h.state(mid) == IDLE, "a refused oversize Configure changed state")
    else:
        expect(dict(ack.machine.shard_metadata) == md, "2 MiB metadata not echoed verbatim in the ack")
        m = h.must_reach(mid, CONFIGURED)
        expect(dict(m.shard_metadata) == md, "2 MiB metadata not echoed verbatim by Get")
        h.drain(mid)
        h.must_reach(mid, IDLE)
    h.release(mid)


@check("core", "C403", "malformed requests are refused and change nothing")
def bad_requests(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    before = h.get(mid)
    code = h.code(h.configure, mid, "")
    non_fencing_rejection(code, "Configure with an empty cluster_id")
    _unchanged(h, mid, before, "Configure with an empty cluster_id")
    for bad_state in (99, -1):
        try:
            got = h.list([bad_state])
        except grpc.RpcError as exc:
            expect(exc.code() == grpc.StatusCode.INVALID_ARGUMENT, f"List(states=[{bad_state}]) answered "
                   f"{exc.code().name}")
        else:
            expect(not got.machines, f"List(states=[{bad_state}]) returned machines")
    h.release(mid)


#: the largest bootstrap blob a shard forwards (BootstrapBlobResponse.user_data is held to it)
BLOB_LIMIT = 1 << 20


@check("core", "C404", "bootstrap_blob: 1 MiB accepted; 3 MiB accepted or INVALID_ARGUMENT/RESOURCE_EXHAUSTED")
def blob_limit(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    ack = h.configure(mid, "conf-blob", None, blob=b"\x00" * BLOB_LIMIT)
    expect(ack.operation_id, "a 1 MiB bootstrap blob (the most a shard sends) was not accepted")
    h.must_reach(mid, CONFIGURED)
    h.drain(mid)
    h.must_reach(mid, IDLE)
    before = h.get(mid)
    try:
        ack = h.configure(mid, "conf-big-blob", None, blob=b"\x00" * (3 << 20))
    except grpc.RpcError as exc:
        # the bound is 1 MiB (the kit refuses above it); the contract also lets a provider take more
        expect(exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED),
               f"3 MiB bootstrap blob answered {exc.code().name}")
        _unchanged(h, mid, before, "refused oversize bootstrap blob")
    else:
        expect(ack.operation_id, "3 MiB bootstrap blob: accepted without an operation id")
        h.must_reach(mid, CONFIGURED)
        h.drain(mid)
        h.must_reach(mid, IDLE)
    h.release(mid)


# ==================================================================================================
# core: field shape and List
# ==================================================================================================


@check("core", "C501", "every machine has a valid shape (ids, states, cost fields, host/cluster rules, taints)")
def shape_all(c: Ctx) -> None:
    lst = c.h.list()
    expect(lst.machines, "List returned no machines")
    problems = [p for m in lst.machines for p in shape_problems(m)]
    expect(not problems, f"{len(problems)} problems: {problems[:5]}")
    ids = [m.id for m in lst.machines]
    expect(len(ids) == len(set(ids)), "List returned duplicate ids")


@check("core", "C502", "List state filters, unions and max_results")
def list_filters(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    full = h.list().machines
    by_state: dict[int, set[str]] = {}
    for m in full:
        by_state.setdefault(m.state, set()).add(m.id)
    for st in (S, IDLE):
        got = h.list([st]).machines
        expect(all(m.state == st for m in got), f"List([{state_name(st)}]) returned other states")
    union = {m.id for m in h.list([S, IDLE]).machines}
    expected = {m.id for m in h.list().machines if m.state in (S, IDLE)}
    expect(union == expected, "multi-state filter is not the exact union")
    if len(full) > 3:
        got = h.list(max_results=3).machines
        expect(1 <= len(got) <= 3, f"max_results=3 returned {len(got)}")
    got = h.list(max_results=1).machines
    expect(len(got) == 1, f"max_results=1 returned {len(got)}")
    expect(len(h.list(max_results=0).machines) == len(full), "max_results=0 capped the result")
    h.release(mid)


@check("core", "C503", "revision: non-empty, bumps on every change, not on reads")
def revision_bumps(c: Ctx) -> None:
    h = c.h
    r0 = h.revision()
    expect(r0, "List.revision is empty (incremental List unsupported)")
    h.get(h.first().id)
    expect(h.revision() == r0, "a read bumped the revision")
    mid = h.pick_speculative()[0]
    h.create(mid)
    lst = h.list()
    r1 = bytes(lst.revision)
    seen = h.listed(mid, lst=lst).state
    expect(r1 != r0, "accepting a Create did not bump the revision")
    h.must_reach(mid, IDLE)
    r2 = h.revision()
    if seen == CREATING:
        expect(r2 != r1, "finishing a Create did not bump the revision")
    h.create(mid)
    expect(h.revision() == r2, "an idempotent retry bumped the revision")
    h.code(h.drain, mid)
    expect(h.revision() == r2, "a rejected call bumped the revision")
    h.release(mid)


@check("core", "C504", "since_revision returns exactly the machines changed after the cursor")
def since_revision(c: Ctx) -> None:
    h = c.h
    r0 = h.revision()
    if not r0:
        raise Skip("provider does not support incremental List")
    quiet = h.list(since=r0)
    expect(not quiet.machines, f"nothing changed, yet since returned {len(quiet.machines)} machines")
    a, b = h.pick_speculative(2)
    h.create(a)
    h.must_reach(a, IDLE)
    got = {m.id for m in h.list(since=r0).machines}
    expect(got == {a}, f"since returned {sorted(got)[:5]}, want exactly [{a}]")
    r1 = h.revision()
    h.create(b)
    h.must_reach(b, IDLE)
    got = {m.id for m in h.list(since=r1).machines}
    expect(got == {b}, f"since(r1) returned {sorted(got)[:5]}, want exactly [{b}]")
    got = {m.id for m in h.list([IDLE], since=r0).machines}
    expect(got == {a, b}, "since combined with a state filter is wrong")
    capped = h.list(max_results=1, since=r0).machines
    expect(len(capped) == 1 and capped[0].id in (a, b), "since with max_results is wrong")
    h.release(a)
    h.release(b)


@check("core", "C505", "malformed or foreign cursors mean a full list, never an error")
def garbage_cursors(c: Ctx) -> None:
    h = c.h
    n = len(h.list().machines)
    # (the last two read as revisions this provider never issued, e.g. ones from before a restart
    # that lost its state: a provider that filtered by them would answer nothing)
    for cur in (b"\x00\xff", b"not-a-number", b" 12", b"1_0", b"0x10", b"9" * 40, "١٢".encode(), b"\xde\xad\xbe\xef",
                b"1000000000000", b"9223372036854775807"):
        got = h.list(since=cur)
        expect(len(got.machines) == n, f"cursor {cur!r:.30} returned {len(got.machines)} of {n} machines")
        expect(got.revision, "revision empty")


@check("core", "C506", "List order varies, so callers picking 'the first' do not collide")
def list_order(c: Ctx) -> None:
    h = c.h
    if len(h.list([S], max_results=8).machines) < 4:
        raise Skip("fewer than 4 SPECULATIVE machines")
    firsts = {h.first([S]).id for _ in range(12)}
    expect(len(firsts) >= 2, "12 successive List(SPECULATIVE, max 1) calls all returned the same machine")


def _full_and_per_state(h: Harness) -> tuple[set[str], set[str]]:
    """The ids of one unfiltered List, and the union of one List per state."""
    full = {m.id for m in h.list().machines}
    per_state: set[str] = set()
    for st in pb.MachineState.values():
        if st != pb.MACHINE_STATE_UNSPECIFIED:
            per_state |= {m.id for m in h.list([st]).machines}
    return full, per_state


@check("core", "C507", "List is complete: a machine is listed in every state it settles in; List = union of its states")
def list_complete(c: Ctx) -> None:
    """A shard builds its inventory from List alone: a machine left out is lost to it (never handed
    out) or, once bound, forgotten with its cluster's node on it. Get cannot stand in for List."""
    h = c.h
    mid = h.pick_speculative()[0]
    h.listed(mid)
    h.listed(mid, [S])
    h.create(mid)
    h.must_reach(mid, IDLE)
    for states in ((), (IDLE,)):
        h.listed(mid, states)
    h.configure(mid, "conf-complete")
    h.must_reach(mid, CONFIGURED)
    for states in ((), (CONFIGURED,)):
        h.listed(mid, states)
    for _ in range(3):  # a machine of an earlier check may move between the Lists: look again
        full, per_state = _full_and_per_state(h)
        if full == per_state:
            break
        time.sleep(0.5)
    expect(per_state <= full, f"{len(per_state - full)} machine(s) listed under their state are missing from the "
                              f"unfiltered List (e.g. {sorted(per_state - full)[:3]})")
    expect(full <= per_state, f"{len(full - per_state)} machine(s) of the unfiltered List are in no state's List")
    h.drain(mid)
    h.must_reach(mid, IDLE)
    h.listed(mid, [IDLE])
    h.release(mid)


# ==================================================================================================
# fault lane (provider started with BIGFLEET_CONFORMANCE_FAULTS=1; see bigfleet.provider.kit.faults)
# ==================================================================================================


def _fault_timeout(c: Ctx) -> float:
    return float(c.params.get("fault_timeout", 2.0))


def _must_fail(c: Ctx, mid: str) -> pb.Machine:
    m = c.h.must_reach(mid, FAILED, _fault_timeout(c) + c.h.settle_timeout)
    expect(m.last_error, "FAILED machine has an empty last_error")
    return m


def _remember_failed(c: Ctx, mid: str) -> None:
    c.shared.setdefault("failed", []).append(mid)


@check("fault", "F601", "a failing Create ends FAILED with last_error")
def fault_create(c: Ctx) -> None:
    h = c.h
    cands = [m.id for m in h.list([S]).machines if m.labels.get("conformance.fault/create") == "error"]
    expect(cands, "no SPECULATIVE machine labelled conformance.fault/create=error: was the provider started "
                  "with BIGFLEET_CONFORMANCE_FAULTS=1?")
    ack = h.create(cands[0])
    expect(ack.operation_id, "Create ack without operation id")
    _must_fail(c, cands[0])
    _remember_failed(c, cands[0])


@check("fault", "F602", "a failing Configure ends FAILED with last_error")
def fault_configure_error(c: Ctx) -> None:
    mid = c.h.walk_to_idle()
    c.h.configure(mid, "fault-error")
    _must_fail(c, mid)
    _remember_failed(c, mid)


@check("fault", "F603", "a hanging Configure times out into FAILED")
def fault_configure_timeout(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    t0 = time.monotonic()
    h.configure(mid, "fault-timeout")
    h.stays_in(mid, CONFIGURING, min(0.5, _fault_timeout(c) / 2))
    _must_fail(c, mid)
    expect(time.monotonic() - t0 >= _fault_timeout(c) * 0.8, "FAILED before the transition timeout elapsed")
    _remember_failed(c, mid)


@check("fault", "F604", "a success arriving after the timeout is discarded")
def fault_late_success(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    h.configure(mid, "fault-slow-ok")
    m = _must_fail(c, mid)
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        now = h.get(mid)
        expect(now.state == FAILED, f"late success moved FAILED to {state_name(now.state)}")
        expect(now.last_error == m.last_error, "last_error changed after the late success")
        time.sleep(0.05)
    _remember_failed(c, mid)


@check("fault", "F605", "a readiness gate that never confirms holds CONFIGURING, then FAILED")
def fault_readiness(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_idle()
    h.configure(mid, "fault-readiness-block")
    h.stays_in(mid, CONFIGURING, min(0.5, _fault_timeout(c) / 2))
    _must_fail(c, mid)
    _remember_failed(c, mid)


@check("fault", "F606", "a failing Drain ends FAILED with last_error")
def fault_drain(c: Ctx) -> None:
    h = c.h
    mid = h.walk_to_configured("fault-drain-error")
    h.drain(mid)
    _must_fail(c, mid)
    _remember_failed(c, mid)


@check("fault", "F607", "FAILED is terminal: every mutation is refused (not FAILED_PRECONDITION), last_error kept")
def fault_terminal(c: Ctx) -> None:
    h = c.h
    failed = c.shared.get("failed") or []
    if not failed:
        raise Skip("no FAILED machine was produced by the earlier fault checks")
    shard = unique_shard("terminal")
    seq = 0
    for mid in failed:
        before = h.get(mid)
        for rpc in ("create", "configure", "drain", "delete"):
            for tok in (ZERO, None):
                seq += 1
                code = h.code(h.call, rpc, mid, tok if tok is not None else Token(shard, 1, seq))
                if rpc == "delete" and code == grpc.StatusCode.UNIMPLEMENTED:
                    continue
                non_fencing_rejection(code, f"{rpc} on FAILED")
        after = h.get(mid)
        expect(after.state == FAILED, f"{mid} left FAILED")
        expect(after.last_error == before.last_error, f"{mid}: last_error changed")
    h.stays_in(failed[0], FAILED, 0.25)


@check("fault", "F608", "FAILED machines are listed, filterable and well-formed; fencing still applies to them")
def fault_listed(c: Ctx) -> None:
    h = c.h
    failed = set(c.shared.get("failed") or [])
    if not failed:
        raise Skip("no FAILED machine was produced by the earlier fault checks")
    got = h.list([FAILED]).machines
    expect(failed <= {m.id for m in got}, "List(states=[FAILED]) misses FAILED machines")
    for m in got:
        expect_shape(m)
    mid = sorted(failed)[0]
    shard = unique_shard("failed-fence")
    h.code(h.create, mid, Token(shard, 2, 2))
    code = h.code(h.create, mid, Token(shard, 2, 1))
    expect(code == FP, f"stale token on a FAILED machine answered {code.name}")


# ==================================================================================================
# durability lane: the runner kills and restarts the provider between `before` and these checks
# ==================================================================================================


def durability_before(h: Harness) -> dict[str, Any]:
    """Drive the provider into a state worth remembering; returns what the checks compare against."""
    shard = unique_shard("durable")
    a = h.walk_to_idle()
    h.create(a, Token(shard, 3, 7))
    b = h.walk_to_idle()
    md = {"bigfleet.lucy.sh/assigned-priority": "7", "nul": "x\x00y", "u": "✓"}
    cfg = h.configure(b, "conf-durable", md, Token(shard, 1, 1))
    h.must_reach(b, CONFIGURED)
    c = h.walk_to_idle()
    hang = h.configure(c, "fault-hang")
    expect(hang.machine.state == CONFIGURING, "fault-hang Configure did not stay CONFIGURING")
    h.must_reach(c, CONFIGURING)
    lst = h.list()
    ops = {cfg.operation_id, hang.operation_id}
    return {
        "shard": shard, "a": a, "b": b, "c": c, "md": md, "cfg_op": cfg.operation_id, "ops": ops,
        "revision": bytes(lst.revision),
        "inventory": {m.id: m.SerializeToString(deterministic=True) for m in lst.machines},
    }


def _before(c: Ctx) -> dict[str, Any]:
    b = c.shared.get("before")
    if b is None:
        raise Skip("durability set-up did not run")
    return b  # type: ignore[no-any-return]


@check("durability", "D701", "after kill -9 and restart: every settled machine is exactly as it was")
def durable_inventory(c: Ctx) -> None:
    b = _before(c)
    now = {m.id: m for m in c.h.list().machines}
    expect(set(now) == set(b["inventory"]), f"machine ids changed: +{sorted(set(now) - set(b['inventory']))[:3]} "
           f"-{sorted(set(b['inventory']) - set(now))[:3]}")
    for mid, raw in b["inventory"].items():
        old = pb.Machine.FromString(raw)
        if old.state in (CREATING, CONFIGURING, DRAINING, DELETING):
            continue
        new = now[mid]
        expect(new.SerializeToString(deterministic=True) == raw, f"{mid} changed across the restart: "
               f"{state_name(old.state)}→{state_name(new.state)}")


@check("durability", "D702", "a transition interrupted by the kill is FAILED with last_error")
def durable_interrupted(c: Ctx) -> None:
    b = _before(c)
    m = c.h.get(b["c"])
    expect(m.state == FAILED, f"interrupted machine is {state_name(m.state)}, want FAILED")
    expect(m.last_error, "interrupted machine has no last_error")


@check("durability", "D703", "fence marks survive the restart")
def durable_fences(c: Ctx) -> None:
    b = _before(c)
    h = c.h
    code = h.code(h.create, b["a"], Token(b["shard"], 3, 7))
    expect(code == FP, f"replayed pre-restart token answered {code.name}, want FAILED_PRECONDITION")
    code = h.code(h.configure, b["b"], "conf-durable", b["md"], Token(b["shard"], 1, 1))
    expect(code == FP, f"replayed pre-restart Configure token answered {code.name}")
    expect(h.code(h.create, b["a"], Token(b["shard"], 3, 8)) == OK, "a newer token after restart was refused")


@check("durability", "D704", "idempotency survives: a Configure retry returns the pre-restart operation id")
def durable_idempotency(c: Ctx) -> None:
    b = _before(c)
    ack = c.h.configure(b["b"], "conf-durable", b["md"], Token(b["shard"], 1, 2))
    expect(ack.operation_id == b["cfg_op"], f"retry got {ack.operation_id!r}, want {b['cfg_op']!r}")
    expect(dict(ack.machine.shard_metadata) == b["md"], "shard_metadata lost across the restart")


@check("durability", "D705", "operation ids are never reused after a restart")
def durable_op_ids(c: Ctx) -> None:
    b = _before(c)
    mid = c.h.pick_speculative()[0]
    ack = c.h.create(mid)
    expect(ack.operation_id not in b["ops"], f"operation id {ack.operation_id!r} was reused")
    c.h.must_reach(mid, IDLE)


@check("durability", "D706", "the revision cursor survives: since(old) returns what changed in recovery")
def durable_revision(c: Ctx) -> None:
    b = _before(c)
    if not b["revision"]:
        raise Skip("provider does not support incremental List")
    got = {m.id for m in c.h.list(since=b["revision"]).machines}
    expect(b["c"] in got, "since(pre-restart revision) misses the machine recovery changed")
    expect(b["b"] not in got, "since(pre-restart revision) returned an unchanged machine")


# ==================================================================================================
# scale lane
# ==================================================================================================


def _p99(xs: list[float]) -> float:
    if len(xs) < 2:
        return xs[0] if xs else 0.0
    return statistics.quantiles(xs, n=100)[98]


@check("scale", "S801", "full List of the whole fleet within budget; every record well-formed")
def scale_list(c: Ctx) -> None:
    h = c.h
    want = int(c.params.get("scale_machines", 0))
    t0 = time.perf_counter()
    lst = h.list(timeout=300)
    dt = time.perf_counter() - t0
    n = len(lst.machines)
    if n < want:
        raise CheckFailed(f"provider has {n} machines, the scale lane wants {want}")
    budget = float(c.params.get("list_budget", 5.0))
    c.shared["report"] = [f"List of {n} machines: {dt * 1000:.0f} ms"]
    expect(dt <= budget, f"List of {n} machines took {dt:.2f}s, budget {budget}s")
    ids = [m.id for m in lst.machines]
    expect(len(ids) == len(set(ids)), "duplicate ids in the full List")
    problems = [p for m in lst.machines for p in shape_problems(m, strict_everywhere=True)]
    expect(not problems, f"{len(problems)} shape problems: {problems[:5]}")
    parts = [len(h.list([s]).machines) for s in (S, CREATING, IDLE, CONFIGURING, CONFIGURED, DRAINING, DELETING,
                                                 FAILED)]
    expect(sum(parts) == n, f"per-state Lists add up to {sum(parts)}, full List has {n}")


@check("scale", "S802", "Get latency p99 within budget")
def scale_get(c: Ctx) -> None:
    h = c.h
    ids = [m.id for m in h.list(max_results=500).machines]
    lat = []
    for mid in ids:
        t0 = time.perf_counter()
        h.get(mid)
        lat.append(time.perf_counter() - t0)
    budget = float(c.params.get("rpc_budget", 0.25))
    p99 = _p99(lat)
    c.shared.setdefault("report", []).append(f"Get p99 {p99 * 1000:.1f} ms over {len(lat)}")
    expect(p99 <= budget, f"Get p99 {p99 * 1000:.1f} ms > {budget * 1000:.0f} ms")


@check("scale", "S803", "burst of concurrent Creates: all accepted fast, distinct ids, all reach IDLE")
def scale_create_burst(c: Ctx) -> None:
    h = c.h
    n = int(c.params.get("scale_burst", 256))
    r0 = h.revision()
    ids = h.pick_speculative(n)
    lat: list[float] = [0.0] * n
    width = 16

    def worker(w: int) -> list[str]:
        ops = []
        for i in range(w, n, width):
            t0 = time.perf_counter()
            ops.append(h.create(ids[i]).operation_id)
            lat[i] = time.perf_counter() - t0
        return ops

    results = fanout(width, worker)
    errs = [r for r in results if isinstance(r, BaseException)]
    expect(not errs, f"{len(errs)} workers failed: {errs[0]!r:.200}" if errs else "")
    ops = [o for r in results if isinstance(r, list) for o in r]
    expect(len(set(ops)) == n, f"{n} Creates produced {len(set(ops))} distinct operation ids")
    budget = float(c.params.get("rpc_budget", 0.25))
    p99 = _p99(lat)
    c.shared.setdefault("report", []).append(f"Create p99 {p99 * 1000:.1f} ms over {n} (16 concurrent)")
    expect(p99 <= budget, f"Create ack p99 {p99 * 1000:.1f} ms > {budget * 1000:.0f} ms")
    want: set[str] = set(ids)
    deadline = time.monotonic() + 120
    while True:
        idle = {m.id for m in h.list([IDLE]).machines} & want
        if idle == want:
            break
        expect(time.monotonic() < deadline, f"only {len(idle)} of {n} reached IDLE")
        time.sleep(0.1)
    if r0:
        got = {m.id for m in h.list(since=r0).machines}
        expect(got == want, f"since(before burst) returned {len(got)} machines, want exactly the {n} created")
    c.shared["burst"] = ids


@check("scale", "S804", "sustained mixed reads from 16 clients: no errors")
def scale_mixed(c: Ctx) -> None:
    h = c.h
    ids = [m.id for m in h.list(max_results=256).machines]
    per = int(c.params.get("scale_mixed_per_client", 100))

    def worker(w: int) -> int:
        for i in range(per):
            if i % 10 == 0:
                h.list([IDLE], max_results=10)
            else:
                h.get(ids[(w * per + i) % len(ids)])
        return per

    t0 = time.perf_counter()
    results = fanout(16, worker)
    dt = time.perf_counter() - t0
    errs = [r for r in results if isinstance(r, BaseException)]
    expect(not errs, f"{len(errs)} clients failed: {errs[0]!r:.200}" if errs else "")
    c.shared.setdefault("report", []).append(f"mixed reads {16 * per / dt:.0f} RPC/s (16 clients)")


@check("durability", "D707", "a graceful stop (SIGTERM) and restart also keeps everything")
def durable_graceful(c: Ctx) -> None:
    before = c.shared.get("graceful_before")
    if before is None:
        raise Skip("graceful restart did not run")
    now = {m.id: m.SerializeToString(deterministic=True) for m in c.h.list().machines}
    expect(set(now) == set(before), "machine ids changed across a graceful restart")
    changed = [mid for mid, raw in before.items() if now[mid] != raw
               and pb.Machine.FromString(raw).state not in (CREATING, CONFIGURING, DRAINING, DELETING)]
    expect(not changed, f"{len(changed)} settled machines changed across a graceful restart: {changed[:3]}")
