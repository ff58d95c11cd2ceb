"""Crash signatures found by fuzzing in other areas' code and not fixed yet.

Each entry names the owning area; the matching explicit repro lives in test_regressions.py
as a non-strict xfail, so a fix shows up as XPASS. Remove the entry once it is fixed.
"""

from __future__ import annotations

import re

KNOWN_OPEN: dict[str, list[re.Pattern[str]]] = {
    # coordinator: FleetState.apply lets AttributeError escape when a "restore" command's
    # "state" is not a dict (apply only catches KeyError/TypeError/ValueError).
    "coordinator_commands": [re.compile(r"^AttributeError: '\w+' object has no attribute 'get'")],
    # operator: a CR with topologySpread.maxSkew above int32 passes the pydantic model, then
    # protobuf refuses the value and build_rollup raises, so the whole roll-up fails.
    "cr_rollup": [re.compile(r"^ValueError: Value out of range")],
    # operator (same bug) and: build_rollup accepts CRs whose resource names / requirement
    # keys / values / group the shard's decoder rejects, so one bad CR makes the shard reject
    # the cluster's whole roll-up; and every coLocation CR carries a NUL byte in its group.
    "cr_to_shard": [
        re.compile(r"^ValueError: Value out of range"),
        re.compile(r"^AssertionError: operator built a roll-up the shard rejects"),
    ],
}


def is_known_open(target: str, exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(p.search(text) for p in KNOWN_OPEN.get(target, []))
