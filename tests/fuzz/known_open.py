"""Crash signatures found by fuzzing in other areas' code and not fixed yet.

Each entry names the owning area; the matching explicit repro lives in test_regressions.py
as a non-strict xfail, so a fix shows up as XPASS. Remove the entry once it is fixed.
"""

from __future__ import annotations

import re

KNOWN_OPEN: dict[str, list[re.Pattern[str]]] = {
    # Nothing open: the coordinator restore, operator maxSkew, CR-vs-shard validation and the
    # co-location group NUL findings were fixed (their repros in test_regressions.py now pass).
}


def is_known_open(target: str, exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(p.search(text) for p in KNOWN_OPEN.get(target, []))
