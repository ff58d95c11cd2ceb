"""`make bench` / `python -m bench [AREA ...]`: run every benchmark module (bench/bench_<area>.py).

Each module exposes ``main(argv: list[str]) -> int`` and prints its own table.
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
    chosen = argv or areas()
    print(f"# bigfleet benchmarks — {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    print(f"# machine: {platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}")
    rc = 0
    for area in chosen:
        print(f"\n## {area}")
        module = importlib.import_module(f"bench.bench_{area}")
        rc |= int(module.main([]) or 0)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
