"""Disruption budgets: how many machines may be taken from a cluster (and from the fleet) per time window.

Pure: no I/O, no clock (callers pass ``now``), no threads, no generated protos. A budget is a list of
rules; each rule allows ``nodes`` disruptions (a count, or a percentage of the cluster's Configured
machines, at least 1) per sliding ``window`` for the reasons it names, and is zero inside its
blackout windows. The tightest rule that covers a reason wins. The shard records every disruption it
dispatches in its replicated state, so the window holds across cycles, restarts and failovers
however often cycles run.
"""

from bigfleet.budget.rules import (
    REASONS,
    Blackout,
    BudgetError,
    BudgetRule,
    Disruption,
    allowance,
    parse_budget,
    parse_rule,
)

__all__ = [
    "REASONS",
    "Blackout",
    "BudgetError",
    "BudgetRule",
    "Disruption",
    "allowance",
    "parse_budget",
    "parse_rule",
]
