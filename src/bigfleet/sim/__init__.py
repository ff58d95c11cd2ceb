"""Deterministic, seeded closed-loop simulator: the real shard against a simulated cloud and clusters.

``run(builtin("withdrawal"))`` returns a ``SimResult`` with the JSON-lines trace, per-cycle stats and
every invariant violation. See docs/simulator.md.
"""

from bigfleet.sim.harness import SimResult, Simulator, run
from bigfleet.sim.invariants import InvariantChecker, Violation
from bigfleet.sim.scenario import BUILTIN, Scenario, ScenarioError, Workload, builtin, load, mixed_fleet

__all__ = ["BUILTIN", "InvariantChecker", "Scenario", "ScenarioError", "SimResult", "Simulator", "Violation",
           "Workload", "builtin", "load", "mixed_fleet", "run"]
