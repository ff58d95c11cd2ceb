"""Pure pieces behind the dashboard: time series, shortfall ages, recent actions, and the
resource sums for "needs vs bound capacity". No I/O and no clock reads: callers pass ``now``."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from bigfleet.needs.quantity import parse_quantity

if TYPE_CHECKING:
    from bigfleet.shard.daemon import CycleRecord

# Resources the page sums; others are shown in the raw tables only.
SUMMED = ("cpu", "memory", "nvidia.com/gpu")


@dataclass(frozen=True)
class Sample:
    """One point of the charts: fleet totals at wall time ``t`` (unix seconds)."""

    t: float
    total: int
    bound: int
    free: int
    needs: int
    unmet: int
    shortfalls: int


class History:
    """A bounded ring of samples; the newest last. A sample closer than ``min_gap`` seconds to the
    previous one replaces it, so fast polling cannot push old points out of the window."""

    def __init__(self, capacity: int = 360, min_gap: float = 1.0) -> None:
        if capacity < 2:
            raise ValueError("capacity must be >= 2")
        self._ring: deque[Sample] = deque(maxlen=capacity)
        self.min_gap = min_gap

    def add(self, s: Sample) -> None:
        if self._ring and s.t - self._ring[-1].t < self.min_gap:
            self._ring[-1] = s
        else:
            self._ring.append(s)

    def __len__(self) -> int:
        return len(self._ring)

    def to_json(self) -> list[dict[str, Any]]:
        return [asdict(s) for s in self._ring]


class ShortfallAges:
    """Remembers when each shortfall key was first seen (wall seconds) while it persists.

    The engine reports age in cycles; operators want wall time, and cycles are irregular (triggered
    by roll-ups), so the dashboard keeps its own first-seen clock per key."""

    def __init__(self) -> None:
        self._first: dict[str, float] = {}

    def update(self, keys: Iterable[str], now: float) -> dict[str, float]:
        current = set(keys)
        self._first = {k: self._first.get(k, now) for k in current}
        return dict(self._first)


@dataclass(frozen=True)
class ActionRow:
    t: float
    cycle: int
    kind: str
    machine_id: str
    cluster_id: str
    detail: str


class ActionLog:
    """The most recent engine actions across cycles (newest first when read)."""

    def __init__(self, capacity: int = 200) -> None:
        self._ring: deque[ActionRow] = deque(maxlen=capacity)
        self._last_cycle = -1

    def add_cycle(self, cycle: int, now: float, actions: Iterable[Any], suppressed: Iterable[Any] = (),
                  mode: str = "") -> int:
        """Record a cycle's actions once (repeat calls for the same cycle are ignored). Suppressed
        actions (paused / dry-run) are kept too, tagged with the mode, so an operator sees what a
        paused shard would have done."""
        if cycle <= self._last_cycle:
            return 0
        self._last_cycle = cycle
        n = 0
        for a in actions:
            self._ring.append(action_row(a, cycle, now))
            n += 1
        for a in suppressed:
            self._ring.append(action_row(a, cycle, now, mode or "suppressed"))
            n += 1
        return n

    def observe_cycle(self, rec: CycleRecord) -> None:
        """A shard's finished cycle (its `CycleRecord`): every cycle's actions, not only those a
        dashboard sample happens to see."""
        dec = rec.decision
        if dec is not None and (dec.actions or dec.suppressed):
            self.add_cycle(rec.cycle, rec.computed_at_unix_nanos / 1e9, dec.actions, dec.suppressed,
                           "" if dec.mode == "normal" else dec.mode)

    def to_json(self, limit: int = 100) -> list[dict[str, Any]]:
        rows = list(self._ring)[-limit:]
        rows.reverse()
        return [asdict(r) for r in rows]


def action_row(a: Any, cycle: int, now: float, mode: str = "") -> ActionRow:
    kind = type(a).__name__
    detail = str(getattr(a, "reason", "") or "")
    if hasattr(a, "priority"):
        detail = f"priority {a.priority}" + (f" {detail}" if detail else "")
    if mode:
        detail = f"{detail} [not executed: {mode}]".strip()
    return ActionRow(now, cycle, kind, str(getattr(a, "machine_id", "")), str(getattr(a, "cluster_id", "") or ""), detail)


def sum_quantities(maps: Iterable[Mapping[str, str]]) -> dict[str, int]:
    """Sum Kubernetes quantity maps into milli-units for the summed resources; bad values are skipped
    (the data already passed wire validation; the dashboard must not fail on a stray one)."""
    out: dict[str, int] = {}
    for m in maps:
        for k in SUMMED:
            v = m.get(k)
            if not v:
                continue
            try:
                out[k] = out.get(k, 0) + parse_quantity(v, k)
            except Exception:
                continue
    return out


def shortfall_key(priority: int, requirements: str, deficit: Mapping[str, str]) -> str:
    return f"{priority}|{requirements}|" + ",".join(f"{k}={deficit[k]}" for k in sorted(deficit))


def needs_vs_bound(
    needs: Mapping[str, Sequence[Mapping[str, str]]], bound: Mapping[str, Sequence[Mapping[str, str]]]
) -> list[dict[str, Any]]:
    """Per cluster: summed demand and summed capacity of machines bound to it (milli-units)."""
    rows = []
    for cid in sorted(set(needs) | set(bound)):
        rows.append({
            "cluster_id": cid,
            "need": sum_quantities(needs.get(cid, [])),
            "bound": sum_quantities(bound.get(cid, [])),
        })
    return rows
