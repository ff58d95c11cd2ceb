"""Input limits shared by every wire entry point, and a per-session frame-rate throttle.

Pure: no I/O, no clock reads (``now`` is always passed in). The shard, provider and operator
call these before doing any real work, so a hostile or buggy peer is rejected cheaply and only
its own session suffers. Over a size limit → :class:`LimitExceeded` (answer
RESOURCE_EXHAUSTED or INVALID_ARGUMENT on that session only); over the frame rate → the
throttle first defers that session's work and closes it only if the flood persists.

The roll-up bounds match :mod:`bigfleet.wire.needs` (which enforces them again while
converting), so the operator can check before sending and the shard before decoding. One
exception: the co-location group is held to 253 characters here, at ingest, while the decoder
still takes up to 4 096 so roll-ups replicated before that limit keep restoring on failover.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from bigfleet.v1alpha1 import capacity_pb2, shard_pb2


class LimitExceeded(ValueError):
    """An input is over a configured bound; ``field`` names where."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Limits:
    """Bounds generous next to any real cluster, small next to what would hurt a shard."""

    max_needs_per_rollup: int = 100_000
    max_requirements_per_need: int = 64
    max_values_per_requirement: int = 1024
    max_spreads_per_need: int = 16
    max_resources_per_need: int = 64
    max_label_key_len: int = 317  # DNS-subdomain prefix (253) + "/" + name (63)
    max_label_value_len: int = 63
    max_resource_value_len: int = 64
    max_id_len: int = 253
    max_group_len: int = 253  # co-location group (= bigfleet.wire.needs.MAX_COLOCATION_GROUP_LEN)
    max_bootstrap_blob_bytes: int = 1 << 20  # cloud user-data limits are 16-256 KiB
    max_bootstrap_error_len: int = 4096
    max_request_id_len: int = 64
    max_metadata_entries: int = 64
    max_metadata_bytes: int = 16 << 10
    max_frame_bytes: int = 256 << 20  # the transport cap; kept here so one place names it


DEFAULT_LIMITS = Limits()


def _text(value: str, max_len: int, fld: str) -> None:
    if len(value) > max_len:
        raise LimitExceeded(fld, f"{len(value)} characters, limit {max_len}")


def _resource_map(mapping: Mapping[str, str], limits: Limits, fld: str) -> None:
    if len(mapping) > limits.max_resources_per_need:
        raise LimitExceeded(fld, f"more than {limits.max_resources_per_need} resources")
    kmax, vmax = limits.max_label_key_len, limits.max_resource_value_len
    for key in mapping:  # key iteration + lookup: upb maps' items() goes through slow ABC views
        value = mapping[key]
        if len(key) > kmax or len(value) > vmax:
            _text(key, kmax, f"{fld}[{key[:32]!r}]")
            _text(value, vmax, f"{fld}[{key[:32]!r}]")


def check_rollup(rollup: capacity_pb2.ClusterCapacityNeeds, limits: Limits = DEFAULT_LIMITS) -> None:
    """Size-check a ClusterCapacityNeeds before it is decoded into the NeedsTable.

    The happy path only compares lengths (field paths are built on the error path alone), so
    the check costs a fraction of the decode it protects.
    """
    _text(rollup.cluster_id, limits.max_id_len, "cluster_id")
    needs = rollup.needs
    if len(needs) > limits.max_needs_per_rollup:
        raise LimitExceeded("needs", f"{len(needs)} needs, limit {limits.max_needs_per_rollup}")
    max_reqs, max_vals = limits.max_requirements_per_need, limits.max_values_per_requirement
    kmax, vmax, spreads, gmax = (limits.max_label_key_len, limits.max_label_value_len,
                                 limits.max_spreads_per_need, limits.max_group_len)
    for i, need in enumerate(needs):
        reqs = need.requirements
        if len(reqs) > max_reqs:
            raise LimitExceeded(f"needs[{i}].requirements", f"{len(reqs)} requirements, limit {max_reqs}")
        for j, req in enumerate(reqs):
            values = req.values
            if len(req.key) > kmax:
                _text(req.key, kmax, f"needs[{i}].requirements[{j}].key")
            if len(values) > max_vals:
                raise LimitExceeded(f"needs[{i}].requirements[{j}].values", f"{len(values)} values, limit {max_vals}")
            if values and max(map(len, values)) > vmax:
                for k, v in enumerate(values):
                    _text(v, vmax, f"needs[{i}].requirements[{j}].values[{k}]")
        spread = need.spread
        if spread:
            if len(spread) > spreads:
                raise LimitExceeded(f"needs[{i}].spread", f"{len(spread)} terms, limit {spreads}")
            for j, sp in enumerate(spread):
                _text(sp.topology_key, kmax, f"needs[{i}].spread[{j}].topology_key")
        _resource_map(need.aggregate_resources, limits, f"needs[{i}].aggregate_resources")
        if need.min_unit:
            _resource_map(need.min_unit, limits, f"needs[{i}].min_unit")
        if len(need.group) > gmax:
            _text(need.group, gmax, f"needs[{i}].group")


def check_bootstrap_response(resp: shard_pb2.BootstrapBlobResponse, limits: Limits = DEFAULT_LIMITS) -> None:
    """A kubelet join blob must stay small: the shard holds it and forwards it to a provider."""
    _text(resp.request_id, limits.max_request_id_len, "request_id")
    if len(resp.user_data) > limits.max_bootstrap_blob_bytes:
        raise LimitExceeded(
            "user_data", f"{len(resp.user_data)} bytes, limit {limits.max_bootstrap_blob_bytes}"
        )
    _text(resp.error, limits.max_bootstrap_error_len, "error")


def check_bootstrap_blob(blob: bytes, limits: Limits = DEFAULT_LIMITS) -> None:
    """The provider-side twin of :func:`check_bootstrap_response` (ConfigureRequest.bootstrap_blob)."""
    if len(blob) > limits.max_bootstrap_blob_bytes:
        raise LimitExceeded("bootstrap_blob", f"{len(blob)} bytes, limit {limits.max_bootstrap_blob_bytes}")


def check_metadata(metadata: Iterable[tuple[str, str | bytes]] | None, limits: Limits = DEFAULT_LIMITS) -> None:
    """Bound the number and total size of a call's invocation metadata."""
    if metadata is None:
        return
    total = 0
    for n, (key, value) in enumerate(metadata, start=1):
        total += len(key) + len(value)
        if n > limits.max_metadata_entries:
            raise LimitExceeded("metadata", f"more than {limits.max_metadata_entries} entries")
        if total > limits.max_metadata_bytes:
            raise LimitExceeded("metadata", f"more than {limits.max_metadata_bytes} bytes")


def check_frame_size(nbytes: int, limits: Limits = DEFAULT_LIMITS) -> None:
    if nbytes > limits.max_frame_bytes:
        raise LimitExceeded("frame", f"{nbytes} bytes, limit {limits.max_frame_bytes}")


# ---- rate limiting ----


@dataclass
class TokenBucket:
    """Classic token bucket: ``rate`` tokens per second, at most ``burst`` stored.

    Time is a float (seconds, any monotonic origin) passed in by the caller; a clock that
    steps backwards is treated as "no time passed" so it can never mint tokens.
    """

    rate: float
    burst: float
    tokens: float = field(default=-1.0)
    last: float | None = None

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError("rate must be a positive finite number")
        if not (self.burst >= 1 and math.isfinite(self.burst)):
            raise ValueError("burst must be a finite number >= 1")
        if self.tokens < 0:
            self.tokens = self.burst

    def _refill(self, now: float) -> None:
        if self.last is not None and now > self.last:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        if self.last is None or now > self.last:
            self.last = now

    def try_take(self, now: float, cost: float = 1.0) -> bool:
        self._refill(now)
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        return False

    def wait_time(self, now: float, cost: float = 1.0) -> float:
        """Seconds until ``cost`` tokens are available (0 if now)."""
        self._refill(now)
        if self.tokens >= cost:
            return 0.0
        return (min(cost, self.burst) - self.tokens) / self.rate


class Verdict(enum.Enum):
    ACCEPT = "accept"  # process now
    DEFER = "defer"  # over the soft rate: coalesce (roll-ups are full replacement) and process later
    CLOSE = "close"  # over the hard rate: end this session with RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class ThrottleConfig:
    """Per-session rates. Operators send a roll-up every 10 s plus on change; any frame type
    above ``hard_frames_per_second`` sustained past its burst is abuse, not load."""

    rollups_per_second: float = 2.0
    rollup_burst: float = 10.0
    hard_frames_per_second: float = 200.0
    hard_frame_burst: float = 2000.0


@dataclass
class SessionThrottle:
    """One per Session. ``on_frame`` for every inbound frame; ``on_rollup`` for roll-ups.

    Roll-ups over the soft rate are deferred: the shard keeps only the newest one in its
    one-slot queue and processes it after :meth:`rollup_delay`. Frames of any kind over the
    hard rate close the session; other clusters' sessions have their own throttles.
    """

    config: ThrottleConfig = field(default_factory=ThrottleConfig)
    rollups: TokenBucket = field(init=False)
    frames: TokenBucket = field(init=False)
    deferred: int = 0
    closed: bool = False

    def __post_init__(self) -> None:
        c = self.config
        self.rollups = TokenBucket(c.rollups_per_second, c.rollup_burst)
        self.frames = TokenBucket(c.hard_frames_per_second, c.hard_frame_burst)

    def on_frame(self, now: float) -> Verdict:
        if self.closed or not self.frames.try_take(now):
            self.closed = True
            return Verdict.CLOSE
        return Verdict.ACCEPT

    def on_rollup(self, now: float) -> Verdict:
        """Call after :meth:`on_frame` accepted the frame."""
        if self.rollups.try_take(now):
            return Verdict.ACCEPT
        self.deferred += 1
        return Verdict.DEFER

    def rollup_delay(self, now: float) -> float:
        return self.rollups.wait_time(now)


def _always(_msg: Any) -> bool:
    return True


def is_rollup_frame(msg: Any) -> bool:
    """Soft-limited frames of ``Shard.Session``: roll-ups (full replacement, safe to delay)."""
    which = getattr(msg, "WhichOneof", None)
    return bool(which is not None and which("payload") == "rollup")


def _no_check(_msg: Any) -> None:
    return None


def check_operator_frame(msg: Any, limits: Limits = DEFAULT_LIMITS) -> None:
    """Per-frame bounds on ``Shard.Session`` input that no decoder downstream enforces.

    Roll-ups are left to the shard's roll-up validation (a bad roll-up is rejected and the
    cluster keeps its last good demand; the session stays up).
    """
    which = getattr(msg, "WhichOneof", None)
    kind = which("payload") if which is not None else None
    if kind == "hello":
        _text(msg.hello.cluster_id, limits.max_id_len, "hello.cluster_id")
        _text(msg.hello.protocol_version, 64, "hello.protocol_version")
    elif kind == "bootstrap_response":
        check_bootstrap_response(msg.bootstrap_response, limits)
    elif kind == "reclaim_ack":
        _text(msg.reclaim_ack.instruction_id, limits.max_request_id_len, "reclaim_ack.instruction_id")


@dataclass(frozen=True)
class StreamLimit:
    """Rate limits for one streaming method, applied per call by the RoleInterceptor.

    Frames for which ``soft(msg)`` is true are *paced*: the next read waits for a token, so
    the sender's own flow control (and its one-slot roll-up queue) absorbs the excess and
    only that stream slows down. Every frame counts against the hard bucket; over it the call
    ends with RESOURCE_EXHAUSTED, as it does when ``check`` raises LimitExceeded for a frame.
    """

    config: ThrottleConfig = field(default_factory=ThrottleConfig)
    soft: Callable[[Any], bool] = _always
    # Raises LimitExceeded for a frame over a size bound; the call ends with RESOURCE_EXHAUSTED.
    check: Callable[[Any], None] = _no_check


SESSION_STREAM_LIMIT = StreamLimit(ThrottleConfig(), is_rollup_frame, check_operator_frame)
