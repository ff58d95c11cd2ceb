"""Fuzz every decoder and wire entry point for a bounded time (``make fuzz``).

Each target is a *harness*: a function of raw bytes that feeds one decoder and lets only
that decoder's typed validation error through as "rejected". Anything else escaping is a
crash: the input is saved under ``--crash-dir`` and the run exits 1. Crashes worth keeping
become files under ``fuzz/regressions/<target>/`` which ``tests/fuzz`` replays on every CI run.

Engines:
  * ``atheris`` — coverage-guided (libFuzzer), one child process per target, when the
    ``atheris`` package imports (``pip install -e '.[fuzz]'``);
  * ``builtin`` — a dependency-free mutation fuzzer over the same harnesses and seeds
    (bit flips, splices, interesting integers); what CI's short run uses.

Structured targets (CapacityRequest objects, coordinator commands, provider call sequences)
decode the fuzzer's bytes through :class:`Reader`, so coverage guidance still steers them.
Targets whose module is not present in this checkout are listed as unavailable, not failed.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import math
import os
import random
import re
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Harness = Callable[[bytes], None]


class Rejected(Exception):
    """Raised by a harness when the decoder rejected the input the documented way."""


# ------------------------------------------------------------------------------------------------
# Bytes → structure
# ------------------------------------------------------------------------------------------------

INTERESTING_STRINGS = (
    "", " ", "a", "cpu", "memory", "nvidia.com/gpu", "zone", "topology.kubernetes.io/zone",
    "kubernetes.io/hostname", "us-east-1a", "In", "NotIn", "Exists", "DoesNotExist", "Same", "Gt",
    "0", "1", "-1", "500m", "1.5", "96", "768Gi", "1e3", "1E18", "9223372036854775807", "1Ei", "0.001m",
    "+1", "1k", "1K", "1Ki", "NaN", "inf", "-0", "1e-3", "\x00", "é", "\u202e", "a b", "a/b/c",
    "x" * 64, "y" * 254, "DoNotSchedule", "ScheduleAnyway", "Pending", "Acknowledged",
)
INTERESTING_INTS = (0, 1, -1, 2, 7, 8, 27, 28, 100, 255, 256, 2**15, 2**31 - 1, -(2**31), 2**31, 2**53,
                    2**63 - 1, -(2**63), 2**63, 2**64)


class Reader:
    """Turns fuzzer bytes into choices, like libFuzzer's FuzzedDataProvider.

    Exhausted input yields zeros/empties, so every byte string decodes to *some* structure.
    """

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        b = self.data[self.pos]
        self.pos += 1
        return b

    def uint(self, nbytes: int) -> int:
        v = 0
        for _ in range(nbytes):
            v = (v << 8) | self.byte()
        return v

    def below(self, n: int) -> int:
        if n <= 1:
            return 0
        return self.uint(1 if n <= 256 else 2 if n <= 65536 else 4) % n

    def bool(self) -> bool:
        return bool(self.byte() & 1)

    def choice(self, seq: Sequence[Any]) -> Any:
        return seq[self.below(len(seq))]

    def integer(self) -> int:
        mode = self.below(4)
        if mode == 0:
            return int(INTERESTING_INTS[self.below(len(INTERESTING_INTS))])
        if mode == 1:
            return self.below(256) - 128
        if mode == 2:
            signed: int = struct.unpack(">q", self.uint(8).to_bytes(8, "big"))[0]
            return signed
        return self.uint(2)

    def number(self) -> float:
        mode = self.below(4)
        if mode == 0:
            specials = (0.0, -0.0, 1.0, -1.0, 0.5, 1e308, -1e308, math.inf, -math.inf, math.nan, 5e-324)
            return specials[self.below(len(specials))]
        if mode == 1:
            raw: float = struct.unpack(">d", self.uint(8).to_bytes(8, "big"))[0]
            return raw
        return self.uint(2) / 100.0

    def text(self, pool: Sequence[str] = INTERESTING_STRINGS, max_len: int = 40) -> str:
        if self.below(3) != 0:
            return str(self.choice(pool))
        n = self.below(max_len + 1)
        raw = bytes(self.byte() for _ in range(n))
        return raw.decode("utf-8", errors="replace")

    def size(self, hi: int) -> int:
        """A small count, occasionally large (limit probing)."""
        if self.below(16) == 0:
            return self.below(hi + 1)
        return self.below(min(hi, 4) + 1)

    def rest(self) -> bytes:
        out = self.data[self.pos :]
        self.pos = len(self.data)
        return out


def json_value(r: Reader, keys: Sequence[str], depth: int = 0) -> Any:
    kind = r.below(8 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return r.bool()
    if kind == 2:
        return r.integer()
    if kind == 3:
        return r.number()
    if kind == 4:
        return r.text()
    if kind == 5:
        return [json_value(r, keys, depth + 1) for _ in range(r.size(6))]
    return {r.text(keys): json_value(r, keys, depth + 1) for _ in range(r.size(6))}


# ------------------------------------------------------------------------------------------------
# Targets
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    build: Callable[[], Harness]  # imports lazily: ImportError = target unavailable here
    seeds: Callable[[], list[bytes]] = field(default=lambda: [b""])


NOW = 1_700_000_000_000_000_000


def _proto_seed_rollup() -> bytes:
    from bigfleet.v1alpha1 import capacity_pb2 as cap

    need = cap.CapacityNeed(
        requirements=[
            cap.NodeSelectorRequirement(key="zone", operator=cap.NodeSelectorRequirement.OPERATOR_IN, values=["a", "b"]),
            cap.NodeSelectorRequirement(key="rack", operator=cap.NodeSelectorRequirement.OPERATOR_SAME),
        ],
        aggregate_resources={"cpu": "96", "memory": "768Gi", "nvidia.com/gpu": "8"},
        priority=1000,
        spread=[cap.TopologySpread(topology_key="zone", max_skew=1, when_unsatisfiable=cap.TopologySpread.WHEN_UNSATISFIABLE_DO_NOT_SCHEDULE)],
        interruption_penalty_bucket=cap.PENALTY_BUCKET_64,
        reclamation_penalty_bucket=cap.PENALTY_BUCKET_PINNED,
        min_unit={"cpu": "8"},
        group="g1",
    )
    return cap.ClusterCapacityNeeds(cluster_id="cluster-a", timestamp_unix_nanos=NOW, needs=[need, need]).SerializeToString()


def _rollup_pipeline() -> Callable[[Any], None]:
    """Limits pre-check, then the shard's decoder, then the NeedsTable it feeds."""
    from bigfleet.needs import NeedsTable, ValidationError
    from bigfleet.security.limits import LimitExceeded, check_rollup
    from bigfleet.wire.needs import rollup_from_proto

    def run(pb: Any) -> None:
        try:
            check_rollup(pb)
        except LimitExceeded as exc:
            raise Rejected(str(exc)) from None
        try:
            cluster_id, needs = rollup_from_proto(pb, NOW)
        except ValidationError as exc:
            raise Rejected(str(exc)) from None
        table = NeedsTable()
        table.replace(cluster_id, needs, NOW)
        table.snapshot()
        table.replace(cluster_id, needs, NOW + 1)  # idempotent replacement must not fail either

    return run


def _t_rollup_bytes() -> Harness:
    from google.protobuf.message import DecodeError

    from bigfleet.v1alpha1 import capacity_pb2 as cap

    pipeline = _rollup_pipeline()

    def harness(data: bytes) -> None:
        try:
            pb = cap.ClusterCapacityNeeds.FromString(data)
        except DecodeError as exc:
            raise Rejected(str(exc)) from None
        pipeline(pb)

    return harness


def _struct_rollup(r: Reader) -> Any:
    from bigfleet.v1alpha1 import capacity_pb2

    cap: Any = capacity_pb2  # raw ints go into enum fields on purpose

    pb = cap.ClusterCapacityNeeds(cluster_id=r.text(("cluster-a", "", "a b", "x" * 300)), timestamp_unix_nanos=r.integer() % 2**63)
    for _ in range(r.size(40)):
        need = pb.needs.add()
        for _ in range(r.size(70)):
            need.requirements.add(
                key=r.text(), operator=r.below(8), values=[r.text() for _ in range(r.size(5))]
            )
        for _ in range(r.size(3)):
            need.aggregate_resources[r.text(("cpu", "memory", "nvidia.com/gpu", ""))] = r.text()
        for _ in range(r.size(2)):
            need.min_unit[r.text(("cpu", "memory"))] = r.text()
        need.priority = max(-(2**31), min(2**31 - 1, r.integer()))
        need.interruption_penalty_bucket = r.below(30)
        need.reclamation_penalty_bucket = r.below(30)
        for _ in range(r.size(3)):
            need.spread.add(topology_key=r.text(), max_skew=max(-(2**31), min(2**31 - 1, r.integer())), when_unsatisfiable=r.below(4))
        need.group = r.text()
    return pb


def _t_rollup_struct() -> Harness:
    pipeline = _rollup_pipeline()

    def harness(data: bytes) -> None:
        pipeline(_struct_rollup(Reader(data)))

    return harness


def _session_seed() -> bytes:
    from bigfleet.v1alpha1 import capacity_pb2, shard_pb2

    msg = shard_pb2.OperatorMessage(rollup=capacity_pb2.ClusterCapacityNeeds.FromString(_proto_seed_rollup()))
    boot = shard_pb2.OperatorMessage(bootstrap_response=shard_pb2.BootstrapBlobResponse(request_id="r", user_data=b"#cloud-config"))
    return msg.SerializeToString() + boot.SerializeToString()  # concatenation = merge: exercises both


def _t_session_frame() -> Harness:
    from google.protobuf.message import DecodeError

    from bigfleet.security.limits import LimitExceeded, check_operator_frame, is_rollup_frame
    from bigfleet.v1alpha1 import shard_pb2

    pipeline = _rollup_pipeline()

    def harness(data: bytes) -> None:
        try:
            msg = shard_pb2.OperatorMessage.FromString(data)
        except DecodeError as exc:
            raise Rejected(str(exc)) from None
        try:
            check_operator_frame(msg)  # what the Session interceptor applies to every frame
        except LimitExceeded as exc:
            raise Rejected(str(exc)) from None
        if is_rollup_frame(msg):
            pipeline(msg.rollup)

    return harness


def _t_quantity() -> Harness:
    from bigfleet.needs import MAX_MILLI, ValidationError, format_quantity, parse_quantity

    def harness(data: bytes) -> None:
        text = data.decode("utf-8", errors="replace")
        try:
            milli = parse_quantity(text, "q")
        except ValidationError as exc:
            raise Rejected(str(exc)) from None
        assert isinstance(milli, int) and abs(milli) <= MAX_MILLI, (text, milli)
        canonical = format_quantity(milli)
        assert parse_quantity(canonical, "q") == milli, (text, milli, canonical)

    return harness


def _machine_seed() -> bytes:
    from bigfleet.v1alpha1 import provider_pb2

    ppb: Any = provider_pb2

    m = ppb.Machine(
        id="m-1", state=2, instance_type="m6i.large", zone="us-east-1a", capacity_type=1, price_per_hour=0.096,
        interruption_probability=0.05, cluster="", labels={"zone": "a"},
        shard_metadata={"bigfleet.lucy.sh/assigned-priority": "100", "bigfleet.lucy.sh/assigned-group": "g"},
    )
    m.resources.resources["cpu"] = "2"
    m.allocatable.resources["memory"] = "8Gi"
    out: bytes = m.SerializeToString()
    return out


def _t_machine() -> Harness:
    from google.protobuf.message import DecodeError

    from bigfleet.needs import ValidationError
    from bigfleet.v1alpha1 import provider_pb2 as ppb
    from bigfleet.wire.machine import machine_from_proto, machine_to_proto

    def harness(data: bytes) -> None:
        try:
            pb = ppb.Machine.FromString(data)
        except DecodeError as exc:
            raise Rejected(str(exc)) from None
        try:
            m = machine_from_proto(pb, now_unix_nanos=NOW)
        except ValidationError as exc:
            raise Rejected(str(exc)) from None
        # What the shard accepted it must be able to send back and re-read.
        machine_from_proto(machine_to_proto(m), now_unix_nanos=NOW)

    return harness


def _t_shard_metadata() -> Harness:
    from bigfleet.wire import machine as wire

    keys = [v for k, v in vars(wire).items() if k.startswith("META_") and isinstance(v, str)] + ["", "x"]

    def harness(data: bytes) -> None:
        r = Reader(data)
        md = {r.text(keys): r.text() for _ in range(r.size(8))}
        wire.decode_shard_metadata(md)  # documented: never raises

    return harness


def _t_provider_calls() -> Harness:
    import grpc

    from bigfleet.provider.kit.core import ProviderCore, check_configure_args
    from bigfleet.provider.kit.model import CapacityType, Fence, Instance, Kind, KitError

    kinds = list(Kind)

    def harness(data: bytes) -> None:
        r = Reader(data)
        core = ProviderCore()
        core.seed(
            [
                Instance(id=f"m-{i}", instance_type="m6i.large", zone="z", capacity_type=CapacityType(1 + i % 2),
                         resources={"cpu": "2"})
                for i in range(3)
            ]
        )
        rejected = 0
        for _ in range(r.size(12)):
            op = r.below(4)
            try:
                if op == 0:
                    fence = Fence(r.text(("shard-0", "shard-1", "")), r.integer(), r.integer())
                    md = {r.text(): r.text() for _ in range(r.size(3))}
                    kind = r.choice(kinds)
                    if kind == Kind.CONFIGURE:
                        check_configure_args(r.text(("cluster-a", "")), md, r.integer())
                    core.mutate(kind, r.text(("m-0", "m-1", "m-2", "")), fence, r.text(("cluster-a", "c")), md)
                elif op == 1:
                    core.get(r.text(("m-0", "m-9", "")))
                elif op == 2:
                    core.list([r.integer() for _ in range(r.size(3))], r.integer(), r.rest()[:24], random.Random(0))
                else:
                    core.restore(core.snapshot())
            except KitError as exc:
                assert isinstance(exc.code, grpc.StatusCode), exc
                rejected += 1
        if rejected:
            raise Rejected(f"{rejected} calls rejected")

    return harness


def _command_keys() -> list[str]:
    from bigfleet.coordinator import state

    src = inspect.getsource(state)
    keys = set(re.findall(r"""cmd(?:\.get\(|\[)["'](\w+)["']""", src))
    return sorted(keys | {"op"})


def _t_coordinator_commands() -> Harness:
    from bigfleet.coordinator import state

    ops = [*sorted(state._HANDLERS), "", "bogus"]
    keys = _command_keys()

    def harness(data: bytes) -> None:
        r = Reader(data)
        st = state.FleetState()
        for _ in range(r.size(10)):
            cmd: dict[str, Any] = {"op": r.choice(ops)}
            for _ in range(r.size(6)):
                k = r.choice(keys)
                cmd[k] = json_value(r, keys) if r.below(3) == 0 else r.choice(
                    [r.text(("shard-0", "shard-1", "cluster-a", "zone", "a")), r.integer(), [r.text()], {}]
                )
            res = st.apply(cmd)  # documented: never raises on bad input
            assert isinstance(res, dict) and "code" in res, res

    return harness


_CR_KEYS = ("metadata", "spec", "status", "name", "namespace", "priority", "resources", "requirements",
            "key", "operator", "values", "interruptionPenalty", "reclamationPenalty", "topologySpread",
            "maxSkew", "topologyKey", "whenUnsatisfiable", "coLocation", "labelSelector", "matchLabels",
            "matchExpressions", "phase", "deletionTimestamp", "cpu", "memory")


def _struct_cr(r: Reader, i: int) -> dict[str, Any]:
    if r.below(8) == 0:
        # The API server guarantees an object-typed metadata; everything else may be junk.
        junk = {r.text(_CR_KEYS): json_value(r, _CR_KEYS) for _ in range(r.size(4))}
        return {**junk, "metadata": {"name": f"raw-{i}"}}
    spec: dict[str, Any] = {
        "priority": r.integer() if r.below(4) == 0 else r.below(2000),
        "resources": {r.text(("cpu", "memory", "nvidia.com/gpu")): (r.text() if r.bool() else r.integer())
                      for _ in range(r.size(4))},
    }
    if r.bool():
        spec["requirements"] = [
            {"key": r.text(), "operator": r.text(("In", "NotIn", "Exists", "DoesNotExist", "Same", "Gt")),
             "values": [r.text() for _ in range(r.size(4))]}
            for _ in range(r.size(4))
        ]
    if r.bool():
        spec["interruptionPenalty"] = r.text() if r.bool() else r.number()
    if r.bool():
        spec["reclamationPenalty"] = r.text() if r.bool() else r.integer()
    if r.bool():
        spec["topologySpread"] = [
            {"maxSkew": r.integer(), "topologyKey": r.text(), "whenUnsatisfiable": r.text()} for _ in range(r.size(2))
        ]
    if r.bool():
        spec["coLocation"] = {"topologyKey": r.text(), "labelSelector": {"matchLabels": {r.text(): r.text()}}}
    return {
        "metadata": {"name": f"cr-{i}", "namespace": r.text(("default", ""))},
        "spec": spec,
        "status": {"phase": r.text(("", "Pending", "Acknowledged"))},
    }


def _t_cr_rollup() -> Harness:
    from bigfleet.operator.rollup import build_rollup

    def harness(data: bytes) -> None:
        r = Reader(data)
        crs = [_struct_cr(r, i) for i in range(r.size(8))]
        build_rollup("cluster-a", crs, NOW)  # documented: invalid CRs are skipped, never fatal

    return harness


def _t_cr_to_shard() -> Harness:
    """End to end: whatever roll-up the operator builds from CRs, the shard must accept."""
    from bigfleet.needs import ValidationError
    from bigfleet.operator.rollup import build_rollup
    from bigfleet.security.limits import check_rollup
    from bigfleet.wire.needs import rollup_from_proto

    def harness(data: bytes) -> None:
        r = Reader(data)
        crs = [_struct_cr(r, i) for i in range(r.size(8))]
        rollup = build_rollup("cluster-a", crs, NOW)
        check_rollup(rollup.message)
        try:
            rollup_from_proto(rollup.message, NOW)
        except ValidationError as exc:
            raise AssertionError(f"operator built a roll-up the shard rejects: {exc}") from None

    return harness


def _t_identity() -> Harness:
    from bigfleet.security.identity import Identity, IdentityError, identity_from_certificate

    def harness(data: bytes) -> None:
        try:
            if data[:1] == b"-":
                identity_from_certificate(data)
            else:
                ident = Identity.parse(data.decode("utf-8", errors="replace"))
                assert Identity.parse(ident.uri) == ident
        except IdentityError as exc:
            raise Rejected(str(exc)) from None

    return harness


TARGETS: dict[str, Target] = {
    t.name: t
    for t in [
        Target("rollup", "protobuf bytes → limits → rollup_from_proto → NeedsTable", _t_rollup_bytes,
               lambda: [_proto_seed_rollup(), b""]),
        Target("rollup_struct", "structured roll-ups (limit probing) → rollup_from_proto → NeedsTable", _t_rollup_struct),
        Target("session_frame", "OperatorMessage bytes → per-frame validation", _t_session_frame,
               lambda: [_session_seed(), b"\x0a\x03\x0a\x01a"]),
        Target("quantity", "Kubernetes quantity strings → parse_quantity (+ canonical round trip)", _t_quantity,
               lambda: [s.encode() for s in ("96", "768Gi", "500m", "1.5", "1e3", "0.1Ki", "9223372036854775807m")]),
        Target("machine", "provider Machine bytes → machine_from_proto (+ to_proto round trip)", _t_machine,
               lambda: [_machine_seed()]),
        Target("shard_metadata", "shard_metadata maps → decode_shard_metadata (never raises)", _t_shard_metadata),
        Target("provider_calls", "provider call sequences → ProviderCore validation/fencing", _t_provider_calls),
        Target("coordinator_commands", "Raft command dicts → FleetState.apply (never raises)", _t_coordinator_commands),
        Target("cr_rollup", "CapacityRequest objects → operator build_rollup (never raises)", _t_cr_rollup),
        Target("cr_to_shard", "CapacityRequests → operator roll-up → accepted by the shard decoder", _t_cr_to_shard),
        Target("identity", "URI SANs and PEM bytes → identity parsing", _t_identity,
               lambda: [b"bigfleet://cluster/a", b"bigfleet://admin", b"-----BEGIN CERTIFICATE-----\n"]),
    ]
}


def load(name: str) -> tuple[Harness | None, str]:
    """The harness for a target, or (None, why) when its code is not in this checkout."""
    try:
        return TARGETS[name].build(), ""
    except ImportError as exc:
        return None, f"unavailable: {exc}"


def run_one(harness: Harness, data: bytes) -> BaseException | None:
    """None for accepted or rejected input; the escaping exception for a crash."""
    try:
        harness(data)
    except Rejected:
        return None
    except RecursionError as exc:
        return exc
    except Exception as exc:
        return exc
    return None


# ------------------------------------------------------------------------------------------------
# The built-in mutation engine
# ------------------------------------------------------------------------------------------------


def mutate(rng: random.Random, data: bytes, corpus: Sequence[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(1 + rng.randrange(4)):
        op = rng.randrange(8)
        if op == 0 and buf:
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf.insert(rng.randrange(len(buf) + 1), rng.randrange(256))
        elif op == 2 and buf:
            del buf[rng.randrange(len(buf))]
        elif op == 3 and buf:
            buf[rng.randrange(len(buf))] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, 0x0A, 0x12, 0x1A))
        elif op == 4 and corpus:
            other = rng.choice(corpus)
            if other:
                a = rng.randrange(len(other))
                chunk = other[a : a + 1 + rng.randrange(32)]
                pos = rng.randrange(len(buf) + 1)
                buf[pos:pos] = chunk
        elif op == 5 and buf:
            a = rng.randrange(len(buf))
            chunk = bytes(buf[a : a + 1 + rng.randrange(16)])
            buf[a:a] = chunk * (1 + rng.randrange(4))
        elif op == 6:
            v = rng.choice(INTERESTING_INTS) & 0xFFFFFFFFFFFFFFFF
            pos = rng.randrange(len(buf) + 1)
            buf[pos:pos] = v.to_bytes(8, rng.choice(("big", "little")))
        elif op == 7:
            pos = rng.randrange(len(buf) + 1)
            buf[pos:pos] = rng.choice(INTERESTING_STRINGS).encode()
    return bytes(buf[: 1 << 16])


@dataclass
class Stats:
    target: str
    engine: str
    execs: int = 0
    crashes: int = 0
    seconds: float = 0.0
    note: str = ""
    crash_files: list[str] = field(default_factory=list)


def crash_signature(exc: BaseException) -> str:
    """Crashes that differ only in the offending value count once."""
    text = re.sub(r"\[[^\]]*\]|'[^']*'|\"[^\"]*\"|\d+", "_", str(exc))
    return f"{type(exc).__name__}:{text[:100]}"


def _save_crash(crash_dir: Path, target: str, data: bytes, exc: BaseException) -> Path:
    crash_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(data).hexdigest()[:16]
    path = crash_dir / f"{target}-{digest}.bin"
    path.write_bytes(data)
    path.with_suffix(".txt").write_text(f"{type(exc).__name__}: {exc}\n")
    return path


def fuzz_builtin(
    name: str,
    *,
    seconds: float,
    max_execs: int | None = None,
    seed: int = 0,
    crash_dir: Path | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Stats:
    """Mutation-fuzz one target until ``seconds`` pass or ``max_execs`` inputs ran."""
    stats = Stats(name, "builtin")
    harness, why = load(name)
    if harness is None:
        stats.note = why
        return stats
    rng = random.Random(seed)
    corpus = list(TARGETS[name].seeds()) or [b""]
    seen_crash: set[str] = set()
    start = clock()

    def inputs() -> Iterator[bytes]:
        yield from corpus
        while True:
            base = rng.choice(corpus)
            yield mutate(rng, base, corpus) if rng.random() < 0.9 else rng.randbytes(rng.randrange(64))

    for data in inputs():
        if max_execs is not None and stats.execs >= max_execs:
            break
        if max_execs is None and clock() - start >= seconds:
            break
        stats.execs += 1
        exc = run_one(harness, data)
        if exc is not None:
            key = crash_signature(exc)
            if key in seen_crash:
                continue
            seen_crash.add(key)
            stats.crashes += 1
            if crash_dir is not None:
                stats.crash_files.append(str(_save_crash(crash_dir, name, data, exc)))
            stats.note = f"{type(exc).__name__}: {str(exc)[:120]}"
        elif len(corpus) < 256 and rng.random() < 0.02:
            corpus.append(data)  # keep some variety without coverage feedback
    stats.seconds = clock() - start
    return stats


# ------------------------------------------------------------------------------------------------
# The atheris engine (child process per target)
# ------------------------------------------------------------------------------------------------


def atheris_available() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


def _atheris_child(name: str, seconds: float, crash_dir: Path, corpus_dir: Path) -> int:  # pragma: no cover
    import atheris

    # Instrument only our own code (the decoders under test); instrumenting grpc, protobuf
    # and cryptography too costs a minute of start-up and adds no useful coverage signal.
    with atheris.instrument_imports(include=["bigfleet"]):
        harness, why = load(name)
    if harness is None:
        print(why)
        return 0
    corpus_dir.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(TARGETS[name].seeds()):
        (corpus_dir / f"seed-{i}").write_bytes(s)
    crash_dir.mkdir(parents=True, exist_ok=True)

    def one(data: bytes) -> None:
        try:
            harness(data)
        except Rejected:
            pass

    args = [sys.argv[0], f"-max_total_time={max(1, int(seconds))}", f"-artifact_prefix={crash_dir}/{name}-",
            "-print_final_stats=1", "-rss_limit_mb=2048", str(corpus_dir)]
    atheris.Setup(args, one)
    atheris.Fuzz()
    return 0


def fuzz_atheris(name: str, *, seconds: float, crash_dir: Path, corpus_root: Path) -> Stats:
    stats = Stats(name, "atheris")
    if load(name)[0] is None:
        stats.note = load(name)[1]
        return stats
    start = time.monotonic()
    cmd = [sys.executable, "-m", "bigfleet.tools.fuzz", "--_atheris-child", name, "--seconds", str(seconds),
           "--crash-dir", str(crash_dir), "--corpus-dir", str(corpus_root / name)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds * 3 + 120)
    stats.seconds = time.monotonic() - start
    out = proc.stdout + proc.stderr
    m = re.search(r"stat::number_of_executed_units:\s*(\d+)", out)
    stats.execs = int(m.group(1)) if m else 0
    if proc.returncode != 0:
        stats.crashes = 1
        found = re.findall(r"Test unit written to (\S+)", out)
        stats.crash_files = found
        lines = out.splitlines()
        marker = [i for i, ln in enumerate(lines) if "Uncaught Python exception" in ln]
        if marker and marker[0] + 1 < len(lines):
            stats.note = lines[marker[0] + 1].strip()[:200]
        else:
            stats.note = " | ".join(ln for ln in lines[-12:] if ln.strip())[-300:]
    return stats


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def _table(rows: Sequence[Stats]) -> str:
    head = f"{'target':<22} {'engine':<8} {'execs':>10} {'exec/s':>9} {'crashes':>7}  note"
    lines = [head, "-" * len(head)]
    for s in rows:
        rate = f"{s.execs / s.seconds:,.0f}" if s.seconds > 0 else "-"
        lines.append(f"{s.target:<22} {s.engine:<8} {s.execs:>10,} {rate:>9} {s.crashes:>7}  {s.note}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bigfleet.tools.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="total time budget, split across the targets")
    p.add_argument("--per-target", action="store_true", help="--seconds applies to each target instead")
    p.add_argument("--target", action="append", default=[], help="run only these targets (repeatable)")
    p.add_argument("--engine", choices=("auto", "builtin", "atheris"), default="auto")
    p.add_argument("--max-execs", type=int, default=None, help="builtin engine: stop after this many inputs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--crash-dir", default="fuzz/crashes")
    p.add_argument("--corpus-dir", default="fuzz/corpus")
    p.add_argument("--list", action="store_true", help="list the targets and exit")
    p.add_argument("--_atheris-child", dest="atheris_child", default="", help=argparse.SUPPRESS)
    ns = p.parse_args(list(sys.argv[1:] if argv is None else argv))

    if ns.atheris_child:  # pragma: no cover - runs inside the libFuzzer child
        return _atheris_child(ns.atheris_child, ns.seconds, Path(ns.crash_dir), Path(ns.corpus_dir))
    if ns.list:
        for t in TARGETS.values():
            print(f"{t.name:<22} {t.description}")
        return 0
    names = ns.target or list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        p.error(f"unknown target(s): {', '.join(unknown)}; see --list")
    engine = ns.engine
    if engine == "auto":
        engine = "atheris" if atheris_available() else "builtin"
    elif engine == "atheris" and not atheris_available():
        p.error("atheris is not installed (pip install -e '.[fuzz]')")
    budget = ns.seconds if ns.per_target else ns.seconds / max(1, len(names))
    crash_dir = Path(ns.crash_dir)
    rows: list[Stats] = []
    for name in names:
        if engine == "atheris":
            s = fuzz_atheris(name, seconds=budget, crash_dir=crash_dir, corpus_root=Path(ns.corpus_dir))
        else:
            s = fuzz_builtin(name, seconds=budget, max_execs=ns.max_execs, seed=ns.seed, crash_dir=crash_dir)
        rows.append(s)
        print(_table([s]).splitlines()[-1], flush=True)
    print()
    print(f"fuzz: engine={engine} budget={budget:.1f}s/target host={os.uname().nodename} python={sys.version.split()[0]}")
    print(_table(rows))
    crashed = [s for s in rows if s.crashes]
    for s in crashed:
        for f in s.crash_files:
            print(f"crash input: {f}")
    return 1 if crashed else 0


if __name__ == "__main__":
    raise SystemExit(main())
