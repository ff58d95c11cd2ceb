"""`make bench` / `python -m bench [AREA ...] [--FLAG ...]`: run every benchmark module (bench/bench_<area>.py).

Each module exposes ``main(argv: list[str]) -> int`` and prints its own table. Arguments from the
first one starting with ``-`` on are passed to each chosen area's ``main`` (e.g.
``python -m bench shard_ha --failover-machines 100000``).
Figures worth keeping go to docs/performance.md with machine, date and command.
"""

from __future__ import annotations

import importlib
import pkgutil
import platform
import sys
import time
from pathlib import Path


def areas() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name[len("bench_"):] for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))


def main(argv: list[str]) -> int:
    cut = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    chosen, flags = argv[:cut] or areas(), argv[cut:]
    print(f"# bigfleet benchmarks — {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    print(f"# machine: {platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}")
    rc = 0
    for area in chosen:
        print(f"\n## {area}")
        module = importlib.import_module(f"bench.bench_{area}")
        rc |= int(module.main(flags) or 0)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
