"""``python -m bigfleet.sim``: run a scenario, or record / verify the golden traces.

    python -m bigfleet.sim run withdrawal            # or a YAML file; prints a summary
    python -m bigfleet.sim record [--dir tests/golden] [NAME ...]   # regenerate on purpose
    python -m bigfleet.sim verify [--dir tests/golden]              # exit 1 on any difference
    python -m bigfleet.sim soak --cycles 10000                       # churn + invariants + memory
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
from pathlib import Path

from bigfleet.observability import configure_logging
from bigfleet.sim.harness import Simulator
from bigfleet.sim.scenario import BUILTIN, Scenario, builtin, load, mixed_fleet

#: scenarios with a golden trace (mixed-fleet is big and is covered by its invariants instead)
GOLDEN = ("capacity-stockout", "priority-inversion", "withdrawal", "provider-configure-failure",
          "hang-and-disconnect", "training-job-topology")
SETTLE = 10
DEFAULT_DIR = Path("tests/golden")


def golden_trace(name: str) -> str:
    res = Simulator(builtin(name), settle_cycles=SETTLE).run()
    lines = list(res.trace)
    lines.append('{"end":true,"final":' + _json(dict(sorted(res.final_states.items()))) + "}")
    return "\n".join(lines) + "\n"


def _json(d: object) -> str:
    import json

    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def _scenario(arg: str) -> Scenario:
    return builtin(arg) if arg in BUILTIN else load(arg)


def soak_config(cycles: int, clusters: int = 12, seed: int = 0x50A4) -> Scenario:
    from dataclasses import replace

    from bigfleet.sim.scenario import Fault

    base = mixed_fleet(clusters, cycles)
    # One window of random provider failures early on (FAILED is terminal, so failures everywhere
    # would only wear the fleet down to nothing), then pure churn.
    faults = (Fault(min(50, cycles // 4), "fail_rate", rate=0.01), Fault(min(300, cycles // 2), "clear"))
    return replace(base, name="soak", seed=seed, churn_every=5, faults=faults)


def rss_bytes() -> int:
    """Resident set size now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def soak(cycles: int, clusters: int = 12) -> int:
    """Churn for ``cycles`` cycles; report invariants, memory growth, and whether it ended settled."""
    marks: list[tuple[int, int]] = []

    def on_cycle(st: object) -> None:
        c = getattr(st, "cycle", 0)
        if c in (cycles // 10, cycles - 1):
            marks.append((c, rss_bytes()))

    started = time.perf_counter()
    sim = Simulator(soak_config(cycles, clusters), settle_cycles=30, on_cycle=on_cycle, keep_trace=False)
    res = sim.run()
    wall = time.perf_counter() - started
    growth = marks[-1][1] - marks[0][1] if len(marks) >= 2 else 0
    print(f"soak: {res.cycles} cycles, {clusters} clusters, wall {wall:.1f}s ({res.cycles / wall:.0f} cycles/s)")
    print(f"  actions {dict(res.totals)}; creates started {res.creates_started}; final {dict(res.final_states)}")
    print(f"  RSS growth from cycle {marks[0][0] if marks else 0} to the end: {growth / 1e6:.2f} MB")
    for v in res.violations[:20]:
        print(f"  VIOLATION {v}")
    return 0 if res.ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bigfleet.sim")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("scenario", help=f"built-in name ({', '.join(sorted(BUILTIN))}) or a YAML file")
    r.add_argument("--settle", type=int, default=SETTLE)
    r.add_argument("--trace", action="store_true", help="print the JSON-lines trace")
    for name in ("record", "verify"):
        g = sub.add_parser(name)
        g.add_argument("--dir", type=Path, default=DEFAULT_DIR)
        g.add_argument("names", nargs="*", default=list(GOLDEN))
    s = sub.add_parser("soak")
    s.add_argument("--cycles", type=int, default=10_000)
    s.add_argument("--clusters", type=int, default=12)
    p.add_argument("--log-level", default="error")
    args = p.parse_args(argv)
    configure_logging(args.log_level, "console", "sim")
    if args.cmd == "run":
        res = Simulator(_scenario(args.scenario), settle_cycles=args.settle).run()
        if args.trace:
            print("\n".join(res.trace))
        print(f"{res.scenario}: {res.cycles} cycles, actions {dict(res.totals)}, final {dict(res.final_states)}, "
              f"violations {len(res.violations)}")
        for v in res.violations:
            print(f"  {v}")
        return 0 if res.ok else 1
    if args.cmd == "record":
        args.dir.mkdir(parents=True, exist_ok=True)
        for name in args.names:
            (args.dir / f"{name}.jsonl").write_text(golden_trace(name))
            print(f"recorded {args.dir / (name + '.jsonl')}")
        return 0
    if args.cmd == "verify":
        bad = 0
        for name in args.names:
            want = (args.dir / f"{name}.jsonl").read_text()
            got = golden_trace(name)
            if got != want:
                bad += 1
                diff = difflib.unified_diff(want.splitlines(), got.splitlines(), "golden", "now", lineterm="", n=1)
                print(f"{name}: trace differs\n" + "\n".join(list(diff)[:40]))
        return 1 if bad else 0
    return soak(args.cycles, args.clusters)


if __name__ == "__main__":
    sys.exit(main())
