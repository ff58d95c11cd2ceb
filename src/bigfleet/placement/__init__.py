"""Cluster → shard placement: bounded-load rendezvous hashing and rebalance planning.

Pure functions (no I/O, no clock, no randomness) so the coordinator's leader,
`bigfleetctl rebalance --plan`, tests and benchmarks all compute the same answer.
"""

from bigfleet.placement.hrw import (
    DEFAULT_LOAD_FACTOR,
    Move,
    RebalancePlan,
    capacity,
    loads,
    place,
    plan_rebalance,
    preferred,
    rank,
    score,
)

__all__ = [
    "DEFAULT_LOAD_FACTOR",
    "Move",
    "RebalancePlan",
    "capacity",
    "loads",
    "place",
    "plan_rebalance",
    "preferred",
    "rank",
    "score",
]
