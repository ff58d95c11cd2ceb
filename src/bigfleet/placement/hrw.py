"""Bounded-load rendezvous (highest-random-weight) hashing over shards.

Why rendezvous: removing a shard moves only that shard's clusters, and adding
one moves only the clusters whose highest score is the newcomer (≈ 1/N).
Why a load bound: with few clusters, or hot spots, plain HRW can overload one
shard; a cluster skips a shard that is at the cap and takes its next choice
(Mirrokni et al.'s bounded loads applied to HRW ranks).

Hashes use blake2b, never Python's ``hash()`` (salted per process), so every
replica, the CLI and the tests rank identically.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_LOAD_FACTOR = 1.25


def score(key: str, shard: str) -> int:
    """The 64-bit rendezvous weight of ``shard`` for ``key``."""
    h = hashlib.blake2b(key.encode() + b"\x00" + shard.encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def _scores(key: str, shards: Iterable[str]) -> list[tuple[int, str]]:
    """``score(key, s)`` for many shards, hashing the key prefix once (same values, ~2x faster)."""
    base = hashlib.blake2b(key.encode() + b"\x00", digest_size=8)
    out = []
    for s in shards:
        h = base.copy()
        h.update(s.encode())
        out.append((int.from_bytes(h.digest(), "big"), s))
    return out


def rank(key: str, shards: Iterable[str]) -> list[str]:
    """Shards from most to least preferred for ``key`` (ties broken by shard id)."""
    return [s for _, s in sorted(_scores(key, set(shards)), key=lambda t: (-t[0], t[1]))]


def preferred(key: str, shards: Iterable[str]) -> str | None:
    """The unbounded HRW owner of ``key``, or None without shards."""
    best: tuple[int, str] | None = None
    for cand in _scores(key, shards):
        if best is None or cand[0] > best[0] or (cand[0] == best[0] and cand[1] < best[1]):
            best = cand
    return None if best is None else best[1]


def capacity(total: int, shards: int, load_factor: float = DEFAULT_LOAD_FACTOR) -> int:
    """Per-shard cap for ``total`` clusters: max(⌈K/N⌉, ⌊c·K/N⌋).

    The floor keeps max/mean ≤ c exactly; the ceiling keeps the sum of caps
    ≥ K so a place always exists.
    """
    if shards <= 0:
        return 0
    if load_factor < 1.0:
        raise ValueError("load factor must be >= 1")
    return max(math.ceil(total / shards), math.floor(load_factor * total / shards))


def loads(bindings: Mapping[str, str], shards: Iterable[str]) -> dict[str, int]:
    """Clusters per shard, counting only ``shards`` (each listed even at zero)."""
    out = dict.fromkeys(shards, 0)
    for shard in bindings.values():
        if shard in out:
            out[shard] += 1
    return out


def place(
    key: str,
    live: Sequence[str],
    current_loads: Mapping[str, int],
    load_factor: float = DEFAULT_LOAD_FACTOR,
) -> str | None:
    """Where a new cluster goes: its highest-ranked live shard below the cap.

    The cap counts the newcomer: cap(K + 1). None when no shard is live.
    """
    if not live:
        return None
    total = sum(current_loads.get(s, 0) for s in live) + 1
    cap = capacity(total, len(live), load_factor)
    for s in rank(key, live):
        if current_loads.get(s, 0) < cap:
            return s
    # Unreachable while caps sum to at least the total; keep a defined answer.
    return rank(key, live)[0]


@dataclass(frozen=True)
class Move:
    cluster_id: str
    from_shard: str
    to_shard: str


@dataclass
class RebalancePlan:
    moves: list[Move]
    total_clusters: int
    live_shards: list[str]
    cap: int
    load_before: dict[str, int]
    load_after: dict[str, int]
    stranded: list[str] = field(default_factory=list)

    @property
    def plan_id(self) -> str:
        """A digest of the moves, so an apply can insist on the plan an admin reviewed."""
        h = hashlib.sha256()
        for m in sorted(self.moves, key=lambda m: m.cluster_id):
            h.update(f"{m.cluster_id}\x00{m.from_shard}\x00{m.to_shard}\n".encode())
        return h.hexdigest()[:16]


def plan_rebalance(
    bindings: Mapping[str, str],
    live: Iterable[str],
    load_factor: float = DEFAULT_LOAD_FACTOR,
    max_moves: int = 0,
    frozen: Iterable[str] = (),
    joined_at: Mapping[str, int] | None = None,
    bound_at: Mapping[str, int] | None = None,
) -> RebalancePlan:
    """Which clusters to move, and no more than balance and new shards call for.

    1. Shed: a live shard above the cap gives up clusters (those it ranks
       lowest first) to their best-ranked live shard with room.
    2. Pull: a cluster moves to its HRW-preferred live shard (if that shard is
       below the cap) when the shard is *newer than the cluster's binding*
       (``joined_at[shard] > bound_at[cluster]``: the cluster would have gone
       there had the shard existed) or the shard holds less than half
       its fair share (⌊mean / 2⌋, e.g. it was down while clusters were placed). Clusters the cap once displaced from a shard that already
       existed stay where they are: moving them back buys no balance.
       Without the two timestamp maps every non-preferred cluster may move
       (pure convergence on HRW).
    Clusters bound to shards that are not live are *stranded*: they stay put
    (their shard cannot release them); removing the shard re-places them.
    ``frozen`` clusters (handoff in flight) are counted but never moved.
    The plan is a fixed point: planning again after applying it (and
    stamping moved bindings with a newer ``bound_at``) moves nothing.
    """
    planner = _Planner(bindings, live, load_factor)
    frozen_set = set(frozen)
    planner.shed(frozen_set)
    planner.converge(frozen_set, joined_at, bound_at)
    return planner.plan(len(bindings), max_moves)


class _Planner:
    """One `plan_rebalance` run: the loads as moves are planned, and the moves so far."""

    def __init__(self, bindings: Mapping[str, str], live: Iterable[str], load_factor: float) -> None:
        self.live = sorted(set(live))
        live_set = set(self.live)
        self.on_live = {c: s for c, s in bindings.items() if s in live_set}
        self.stranded = sorted(c for c, s in bindings.items() if s not in live_set)
        self.before = loads(self.on_live, self.live)
        self.after = dict(self.before)
        self.cap = capacity(len(self.on_live), len(self.live), load_factor)
        self.current = dict(self.on_live)
        self.moves: dict[str, Move] = {}

    def move(self, cluster: str, to: str) -> None:
        frm = self.on_live[cluster]
        self.after[self.current[cluster]] -= 1
        self.after[to] += 1
        self.current[cluster] = to
        if to == frm:
            self.moves.pop(cluster, None)
        else:
            self.moves[cluster] = Move(cluster, frm, to)

    def shed(self, frozen: set[str]) -> None:
        """1. Over-cap shards give up the clusters they rank lowest to their best live shard with room."""
        by_shard: dict[str, list[str]] = {s: [] for s in self.live}
        for c, s in sorted(self.on_live.items()):
            by_shard[s].append(c)
        after, cap = self.after, self.cap
        for s in self.live:
            excess = after[s] - cap
            if excess <= 0:
                continue
            candidates = [c for c in by_shard[s] if c not in frozen]
            candidates.sort(key=lambda c: (score(c, s), c))
            for c in candidates:
                if excess <= 0:
                    break
                for t in rank(c, self.live):
                    if t != s and after[t] < cap:
                        self.move(c, t)
                        excess -= 1
                        break

    def converge(self, frozen: set[str], joined_at: Mapping[str, int] | None,
                 bound_at: Mapping[str, int] | None) -> None:
        """2. Clusters move to their HRW-preferred shard where it has room and the move is wanted.

        A cluster that reached its preferred shard never moves again, so the passes end; repeating
        them makes the plan a fixed point (a move that frees room can unblock an earlier cluster)."""
        floor = math.floor(len(self.on_live) / len(self.live) / 2) if self.live else 0
        after = self.after

        def wanted(c: str, top: str) -> bool:
            if joined_at is None or bound_at is None:
                return True
            newer = joined_at.get(top, 0) > bound_at.get(c, 0)
            return newer or after[top] < floor

        pending: list[tuple[str, str]] = []
        for c in sorted(self.current):
            if c in frozen:
                continue
            top = preferred(c, self.live)
            if top is not None and top != self.current[c]:
                pending.append((c, top))
        progress = True
        while progress and pending:
            progress = False
            waiting: list[tuple[str, str]] = []
            for c, top in pending:
                if after[top] < self.cap and wanted(c, top):
                    self.move(c, top)
                    progress = True
                else:
                    waiting.append((c, top))
            pending = waiting

    def plan(self, total: int, max_moves: int) -> RebalancePlan:
        out = sorted(self.moves.values(), key=lambda m: m.cluster_id)
        after = self.after
        if max_moves > 0 and len(out) > max_moves:
            out = out[:max_moves]
            after = dict(self.before)
            for m in out:
                after[m.from_shard] -= 1
                after[m.to_shard] += 1
        return RebalancePlan(moves=out, total_clusters=total, live_shards=self.live, cap=self.cap,
                             load_before=self.before, load_after=after, stranded=self.stranded)


def max_over_mean(shard_loads: Mapping[str, int]) -> float:
    """Balance figure used by tests and benchmarks."""
    if not shard_loads:
        return 0.0
    total = sum(shard_loads.values())
    if total == 0:
        return 0.0
    return max(shard_loads.values()) / (total / len(shard_loads))


def count_by_shard(bindings: Mapping[str, str]) -> Counter[str]:
    return Counter(bindings.values())
