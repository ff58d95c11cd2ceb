"""The simulator's ``consolidation`` scenario: a service on on-demand machines moves onto committed
hosts freed by another cluster's finished job. With consolidation $/hour falls to the committed
price and stays there (no move back, no action in the last cycles); without it nothing moves."""

from __future__ import annotations

import json
from dataclasses import replace

from bigfleet.sim.harness import Simulator
from bigfleet.sim.scenario import builtin


def test_cost_falls_and_stays_flat() -> None:
    on = Simulator(builtin("consolidation")).run()
    off = Simulator(replace(builtin("consolidation"), consolidation=False)).run()
    assert on.ok, on.violations[:5]
    assert off.ok, off.violations[:5]
    cost_on = [s.cost_per_hour for s in on.stats]
    cost_off = [s.cost_per_hour for s in off.stats]
    peak = max(cost_on)
    assert peak > 1.0 and cost_off[-1] == peak  # 4 on-demand machines, kept without consolidation
    assert cost_on[-1] < 0.1 * peak  # moved onto the free committed hosts, on-demand released
    tail = cost_on[-15:]
    assert max(tail) == min(tail)  # stable: no flapping
    late = [json.loads(line) for line in on.trace[-15:]]
    assert all(not rec.get("actions") for rec in late)
    # each move was create-before-drain: as many replacements as machines retired
    assert on.totals["Configure"] - off.totals["Configure"] == on.totals["Drain"] - off.totals["Drain"] == 4
