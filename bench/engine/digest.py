"""Decision digests of the engine benchmark shapes: one hash per (shape, cycle).

A speed-up of the engine must not change what it decides. Run this before and after a change (or on two
checkouts, ``PYTHONPATH=<checkout>/src:<checkout>``) and compare the output line by line:

    .venv/bin/python -m bench.engine.digest            # 1/10 scale, every shape
    .venv/bin/python -m bench.engine.digest 0.02 unmet # smaller, one shape

Each shape runs a cold cycle and then churned cycles like its benchmark (demand changes, the previous
cycle's actions land, reclaims start draining). The digest covers actions, shortfalls, verdicts, the
carried state and the deterministic counts; the reuse counters (``clusters_recomputed``/``_reused``) are
left out because an incremental change may legitimately recompute less.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from bench.bench_engine import _table
from bench.engine import shapes
from bigfleet.decision import Configure, Create, Decision, Drain, Engine, EngineConfig, EngineState, Verdict
from bigfleet.machine import Inventory, MachineState
from bigfleet.needs import NeedsTable

S = MachineState
_SKIP_STATS = {"clusters_recomputed", "clusters_reused"}


def canon(x: Any) -> Any:
    """A hash-seed independent plain form: sets and mappings sorted, dataclasses as field tuples."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, tuple((f.name, canon(getattr(x, f.name))) for f in dataclasses.fields(x)
                                        if f.name not in _SKIP_STATS))
    if isinstance(x, dict) or (hasattr(x, "items") and callable(x.items)):
        return tuple(sorted((repr(canon(k)), canon(v)) for k, v in x.items()))
    if isinstance(x, (set, frozenset)):
        return tuple(sorted(repr(canon(v)) for v in x))
    if isinstance(x, (list, tuple)):
        return tuple(canon(v) for v in x)
    if hasattr(x, "value") and hasattr(x, "name") and not isinstance(x, (str, bytes)):
        return repr(x)
    return x


def _verdict(v: Verdict, cycle: int) -> Any:
    """A verdict's plain form with its unmet streak as an age (as verdicts carried it before they
    held the streak's start: digests taken before and after that change compare equal)."""
    return (type(v).__name__, tuple(("age_cycles_unmet", v.age_at(cycle)) if f.name == "unmet_since"
                                    else (f.name, canon(getattr(v, f.name))) for f in dataclasses.fields(v)))


def digest(d: Decision) -> str:
    verdicts = tuple(_verdict(v, d.state.cycle) for v in d.verdicts)
    body = (canon(d.actions), canon(d.shortfalls), verdicts, canon(d.stats), canon(d.state),
            canon(d.deferred), d.mode)
    return hashlib.sha256(repr(body).encode()).hexdigest()[:16]


def _land(inv: Inventory, d: Decision) -> None:
    for a in d.actions:
        m = inv[a.machine_id]
        if isinstance(a, (Configure, Create)):
            inv.upsert(m.replace(state=S.CONFIGURED, cluster=a.cluster_id, host_provider="bench", host_ref=m.id,
                                 assigned_priority=a.priority, assigned_need_fingerprint=a.need_fingerprint,
                                 assigned_group=a.group))
        elif isinstance(a, Drain):
            inv.transition(a.machine_id, S.DRAINING, 1)


def _run(table: NeedsTable, inv: Inventory, churn: Callable[[int], None], cycles: int = 4) -> Iterator[str]:
    eng = Engine()
    st = EngineState(first_rollup=frozenset(table.clusters()))
    cfg = EngineConfig()
    for r in range(cycles):
        if r:
            churn(r)
        d = eng.decide(table, inv, 10**18, st, cfg)
        st = d.state
        _land(inv, d)
        yield digest(d)


def shape_runs(scale: float) -> dict[str, Callable[[], Iterator[str]]]:
    def uber5k() -> Iterator[str]:
        needs, inv = shapes.uber5k(max(1, int(20 * scale)))
        return _run(_table(needs), inv, lambda r: None)

    def realistic50k() -> Iterator[str]:
        needs, inv = shapes.realistic50k(int(60_000 * scale), 50, int(1000 * scale))
        return _run(_table(needs), inv, lambda r: None)

    def aggregated500k() -> Iterator[str]:
        n_clusters = max(10, int(5000 * scale))
        needs, inv, names = shapes.aggregated500k(int(500_000 * scale), n_clusters)
        table = _table(needs)
        each = max(1, int(500_000 * scale * 0.98) // n_clusters // 10)

        def churn(r: int) -> None:
            for c in names[r::100][: max(1, n_clusters // 100)]:
                table.replace(c, shapes.agg_needs(c, 10, each, bump=r % 2), 1)
        return _run(table, inv, churn)

    def phase2() -> Iterator[str]:
        needs, inv = shapes.phase2_inversions(int(500_000 * scale), 100)
        return _run(_table(needs), inv, lambda r: None)

    def phase3() -> Iterator[str]:
        needs, inv, _ = shapes.phase3_high_demand(int(500_000 * scale), 50)
        return _run(_table(needs), inv, lambda r: None)

    def unmet() -> Iterator[str]:
        n_clusters = max(10, int(500 * scale))
        needs, inv, names = shapes.unmet_demand(int(50_000 * scale), int(6_000 * scale), n_clusters)
        per = len(needs) // n_clusters
        table = _table(needs)

        def churn(r: int) -> None:
            for c in names[r::100][: max(1, n_clusters // 100)]:
                table.replace(c, shapes.unmet_needs(c, per, bump=1 + r % 2), 1)
        return _run(table, inv, churn)

    return {"uber5k": uber5k, "realistic50k": realistic50k, "aggregated500k": aggregated500k,
            "phase2": phase2, "phase3": phase3, "unmet": unmet}


def main(argv: list[str]) -> int:
    nums = [a for a in argv if a.replace(".", "", 1).isdigit()]
    scale = float(nums[0]) if nums else 0.1
    runs = shape_runs(scale)
    which = [a for a in argv if a in runs] or list(runs)
    for name in which:
        for i, h in enumerate(runs[name]()):
            print(f"{name} cycle {i}: {h}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
