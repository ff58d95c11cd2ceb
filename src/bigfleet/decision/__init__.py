"""The decision engine: a pure, deterministic function from (demand, inventory, time, carried state)
to actions, shortfalls and verdicts. See docs/decision-engine.md for the rules and the public API.
"""

from __future__ import annotations

from bigfleet.decision.engine import Engine, choose_same_bucket, decide, decide_indexed, normalize
from bigfleet.decision.index import Index, build_index
from bigfleet.decision.types import (
    REASON_IDLE,
    REASON_PREEMPT,
    REASON_RECLAIM,
    REASON_RELEASE,
    REASON_SPECULATIVE,
    Action,
    Configure,
    Create,
    Decision,
    Delete,
    Drain,
    EngineConfig,
    EngineState,
    MatchingSupply,
    PhaseStats,
    Shortfall,
    UnmetReason,
    Verdict,
    drain_grace_seconds,
    effective_cost,
    victim_score,
)

__all__ = [
    "REASON_IDLE",
    "REASON_PREEMPT",
    "REASON_RECLAIM",
    "REASON_RELEASE",
    "REASON_SPECULATIVE",
    "Action",
    "Configure",
    "Create",
    "Decision",
    "Delete",
    "Drain",
    "Engine",
    "EngineConfig",
    "EngineState",
    "Index",
    "MatchingSupply",
    "PhaseStats",
    "Shortfall",
    "UnmetReason",
    "Verdict",
    "build_index",
    "choose_same_bucket",
    "decide",
    "decide_indexed",
    "drain_grace_seconds",
    "effective_cost",
    "normalize",
    "victim_score",
]
