"""Disruption budget rules: parsing, sliding windows, percentages, reasons and blackouts."""

from __future__ import annotations

import calendar

import pytest

from bigfleet.budget import BudgetError, Disruption, allowance, parse_budget, parse_rule

NS = 1_000_000_000


def at(y: int, mo: int, d: int, h: int = 0, mi: int = 0) -> int:
    return calendar.timegm((y, mo, d, h, mi, 0)) * NS


def test_percentage_is_of_configured_and_at_least_one() -> None:
    r = parse_rule("5%/cycle", cycle_seconds=10)
    assert r.window_seconds == 10 and r.reasons == {"reclaim", "release", "consolidate"}
    assert [r.nodes(n) for n in (0, 1, 19, 20, 40, 100)] == [0, 1, 1, 1, 2, 5]
    assert parse_rule("0%/1m").nodes(100) == 0 and parse_rule("3/1h").nodes(0) == 3


def test_sliding_window_counts_only_recent_disruptions_of_covered_reasons() -> None:
    rules = parse_budget(["10%/10m"])
    now = at(2026, 11, 24, 12)
    hist = [Disruption(f"m{i}", "reclaim", now - i * 60 * NS) for i in range(15)]  # one a minute
    # 40 Configured -> 4 per 10 minutes; the last 10 minutes hold m0..m9 (10 > 4)
    assert allowance(rules, "reclaim", 40, hist, now) == 0
    assert allowance(rules, "reclaim", 40, hist[:2], now) == 2
    assert allowance(rules, "reclaim", 40, [Disruption("x", "reclaim", now - 11 * 60 * NS)], now) == 4
    assert allowance(rules, "preempt", 40, hist, now) is None  # preemption is not covered by default
    assert allowance(rules, "reclaim", 40, [Disruption("p", "preempt", now)] * 9, now) == 4


def test_tightest_rule_wins_and_preempt_only_when_named() -> None:
    rules = parse_budget(["50%/1h", "2/5m;reasons=reclaim,preempt"])
    now = at(2026, 11, 24, 12)
    hist = [Disruption("a", "reclaim", now - 60 * NS)]
    assert allowance(rules, "reclaim", 100, hist, now) == 1
    assert allowance(rules, "release", 100, hist, now) == 49
    assert allowance(rules, "preempt", 100, hist, now) == 1


def test_blackout_windows_allow_nothing_including_across_midnight() -> None:
    rules = parse_budget(["100%/1m;blackout=Mon-Fri 09:00-17:00|Sat 22:00-02:00"])
    tuesday_noon, tuesday_night = at(2026, 11, 24, 12), at(2026, 11, 24, 20)  # 2026-11-24 is a Tuesday
    assert allowance(rules, "reclaim", 10, [], tuesday_noon) == 0
    assert allowance(rules, "reclaim", 10, [], tuesday_night) == 10
    assert allowance(rules, "reclaim", 10, [], at(2026, 11, 28, 23)) == 0  # Saturday 23:00
    assert allowance(rules, "reclaim", 10, [], at(2026, 11, 29, 1)) == 0  # Sunday 01:00, Saturday's window
    assert allowance(rules, "reclaim", 10, [], at(2026, 11, 29, 3)) == 10


@pytest.mark.parametrize("bad", ["", "5", "x/1m", "5/", "5/10", "101%/1m", "5/0s", "5/1m;reasons=nap",
                                 "5/1m;blackout=Someday 09:00-10:00", "5/1m;blackout=Mon 25:00-26:00",
                                 "5/1m;colour=red", "5/1m;blackout=Mon 09:00-09:00"])
def test_bad_rules_are_refused_with_a_reason(bad: str) -> None:
    with pytest.raises(BudgetError):
        parse_rule(bad)
