"""Budget rules: parsing and the allowance arithmetic.

A rule is written ``NODES/WINDOW[;reasons=R,...][;blackout=DAYS HH:MM-HH:MM|...]``:

* ``NODES``: a count (``5``) or a percentage of the cluster's Configured machines (``10%``, at least
  one machine whenever the cluster has any);
* ``WINDOW``: a duration (``30s``, ``10m``, ``1h``, ``1d``) or ``cycle`` (the shard's
  ``--cycle-interval``): at most NODES disruptions in any sliding window of that length;
* ``reasons``: which disruptions the rule limits, of ``reclaim`` (Phase 3: demand withdrawn),
  ``release`` (an idle elastic machine handed back), ``consolidate`` (replaced by cheaper supply) and
  ``preempt`` (Phase 2); default ``reclaim,release,consolidate``;
* ``blackout``: UTC schedule windows in which the rule allows nothing, e.g. ``Mon-Fri 09:00-17:00``
  or ``* 00:00-06:00`` (``|`` separates several; a window may cross midnight).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

REASONS = ("reclaim", "preempt", "release", "consolidate")
VOLUNTARY = frozenset({"reclaim", "release", "consolidate"})
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
NS = 1_000_000_000
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class BudgetError(ValueError):
    pass


@dataclass(frozen=True)
class Blackout:
    """A weekly UTC window: ``days`` (0 = Monday) from ``start`` to ``end`` minute of the day."""

    days: frozenset[int]
    start: int
    end: int

    def covers(self, unix_nanos: int) -> bool:
        secs = unix_nanos // NS
        day = (secs // 86400 + 3) % 7  # 1970-01-01 was a Thursday
        minute = (secs % 86400) // 60
        if self.start <= self.end:
            return day in self.days and self.start <= minute < self.end
        # crosses midnight: the part after midnight belongs to the previous day's window
        return (day in self.days and minute >= self.start) or ((day - 1) % 7 in self.days and minute < self.end)


@dataclass(frozen=True)
class BudgetRule:
    count: int | None  # absolute allowance, or None when ``percent`` is set
    percent: float | None  # fraction of Configured machines (0.10 for "10%")
    window_seconds: float
    reasons: frozenset[str] = VOLUNTARY
    blackouts: tuple[Blackout, ...] = ()
    text: str = ""

    def nodes(self, configured: int) -> int:
        if self.percent is None:
            return int(self.count or 0)
        if self.percent <= 0:
            return 0
        return max(1, math.floor(self.percent * configured + 1e-9)) if configured > 0 else 0

    def blacked_out(self, now_unix_nanos: int) -> bool:
        return any(b.covers(now_unix_nanos) for b in self.blackouts)


@dataclass(frozen=True)
class Disruption:
    machine_id: str
    reason: str
    at_unix_nanos: int


def allowance(rules: Sequence[BudgetRule], reason: str, configured: int, history: Iterable[Disruption],
              now_unix_nanos: int) -> int | None:
    """How many more ``reason`` disruptions the rules allow now; None when no rule covers it."""
    covering = [r for r in rules if reason in r.reasons]
    if not covering:
        return None
    past = list(history)
    left: int | None = None
    for r in covering:
        if r.blacked_out(now_unix_nanos):
            return 0
        since = now_unix_nanos - int(r.window_seconds * NS)
        used = sum(1 for d in past if d.at_unix_nanos > since and d.reason in r.reasons)
        room = max(0, r.nodes(configured) - used)
        left = room if left is None else min(left, room)
    return left


def parse_duration(text: str, cycle_seconds: float) -> float:
    t = text.strip().lower()
    if t == "cycle":
        return cycle_seconds
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd])", t)
    if not m:
        raise BudgetError(f"window {text!r}: want a duration like 30s, 10m, 1h, 1d, or 'cycle'")
    secs = float(m.group(1)) * _UNITS[m.group(2)]
    if secs <= 0:
        raise BudgetError(f"window {text!r} must be longer than zero")
    return secs


def _days(text: str) -> frozenset[int]:
    t = text.strip().lower()
    if t == "*":
        return frozenset(range(7))
    out: set[int] = set()
    for part in t.split(","):
        if "-" in part:
            a, b = (p.strip()[:3] for p in part.split("-", 1))
            if a not in DAYS or b not in DAYS:
                raise BudgetError(f"days {text!r}: use Mon..Sun, ranges like Mon-Fri, or *")
            i, j = DAYS.index(a), DAYS.index(b)
            out.update(range(i, j + 1) if i <= j else [*range(i, 7), *range(0, j + 1)])
        else:
            d = part.strip()[:3]
            if d not in DAYS:
                raise BudgetError(f"days {text!r}: use Mon..Sun, ranges like Mon-Fri, or *")
            out.add(DAYS.index(d))
    return frozenset(out)


def _minute(text: str) -> int:
    m = re.fullmatch(r"(\d{1,2}):(\d{2})", text.strip())
    if not m or int(m.group(1)) > 24 or int(m.group(2)) > 59 or (int(m.group(1)) == 24 and int(m.group(2))):
        raise BudgetError(f"time {text!r}: want HH:MM (UTC, 00:00-24:00)")
    return int(m.group(1)) * 60 + int(m.group(2))


def parse_blackout(text: str) -> Blackout:
    try:
        days, span = text.strip().rsplit(" ", 1)
        start, end = span.split("-", 1)
    except ValueError:
        raise BudgetError(f"blackout {text!r}: want 'DAYS HH:MM-HH:MM', e.g. 'Mon-Fri 09:00-17:00'") from None
    b = Blackout(_days(days), _minute(start), _minute(end))
    if b.start == b.end:
        raise BudgetError(f"blackout {text!r} is empty")
    return b


def parse_rule(text: str, cycle_seconds: float = 10.0) -> BudgetRule:
    parts = [p.strip() for p in text.split(";") if p.strip()]
    if not parts or "/" not in parts[0]:
        raise BudgetError(f"budget {text!r}: want NODES/WINDOW, e.g. 10%/10m or 5/1h")
    nodes, window = parts[0].split("/", 1)
    nodes = nodes.strip()
    count: int | None = None
    percent: float | None = None
    if nodes.endswith("%"):
        try:
            percent = float(nodes[:-1]) / 100.0
        except ValueError:
            raise BudgetError(f"budget {text!r}: bad percentage {nodes!r}") from None
        if not 0 <= percent <= 1:
            raise BudgetError(f"budget {text!r}: a percentage must be within 0%-100%")
    else:
        if not nodes.isdigit():
            raise BudgetError(f"budget {text!r}: NODES must be a count or a percentage, got {nodes!r}")
        count = int(nodes)
    reasons = VOLUNTARY
    blackouts: list[Blackout] = []
    for opt in parts[1:]:
        key, _, val = opt.partition("=")
        key = key.strip().lower()
        if key == "reasons":
            rs = frozenset(r.strip().lower() for r in val.split(",") if r.strip())
            unknown = rs - set(REASONS)
            if not rs or unknown:
                raise BudgetError(f"budget {text!r}: reasons must be among {', '.join(REASONS)}")
            reasons = rs
        elif key == "blackout":
            blackouts += [parse_blackout(b) for b in val.split("|") if b.strip()]
        else:
            raise BudgetError(f"budget {text!r}: unknown option {key!r} (reasons=, blackout=)")
    return BudgetRule(count, percent, parse_duration(window, cycle_seconds), reasons, tuple(blackouts), text.strip())


def parse_budget(texts: Iterable[str], cycle_seconds: float = 10.0) -> tuple[BudgetRule, ...]:
    return tuple(parse_rule(t, cycle_seconds) for t in texts if t.strip())
