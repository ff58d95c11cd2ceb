"""Run a ``bigfleet`` command with a thread that logs its own wake-up lateness (diagnostics for
``bench_shard_ha --failover-probe``).

A thread that sleeps 10 ms in a loop and wakes late was kept off the CPU: by the GIL (another
thread of the same process ran C code that does not release it: a large protobuf parse, a pickle,
a garbage collection) or by the OS scheduler (a loaded box). ``--control`` runs the probe alone in
its own process, which only the scheduler can delay, so comparing the two separates the causes.
A shard's Raft member (pysyncobj) is such a thread: while it is kept off the CPU it sends no
heartbeats and answers no votes.

    python -m bench.stall_probe shard --shard-id s1 ...   # a shard with the probe thread
    python -m bench.stall_probe --control                 # the probe alone

Diagnostics only: with ``BENCH_RAFT_TIMEOUTS=MIN,MAX,FALLBACK`` (seconds) the shard's Raft member
runs with those election timeouts and leader fallback instead of the shipped 3, 6 and 6 s
(``bigfleet.raft.settings``), to see what a takeover costs when leadership does not flap.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import UTC, datetime
from typing import Any

PERIOD = 0.01
REPORT_ABOVE = 0.1  # seconds late


def probe(tag: str) -> None:
    last = time.monotonic()
    while True:
        time.sleep(PERIOD)
        now = time.monotonic()
        late = now - last - PERIOD
        if late > REPORT_ABOVE:
            sys.stderr.write(json.dumps({"event": "probe stall", "probe": tag, "stall_s": round(late, 3),
                                         "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z")}) + "\n")
            sys.stderr.flush()
        last = now


def _override_raft_timeouts(election_min: float, election_max: float, fallback: float) -> None:
    from bigfleet.raft import bridge

    shipped: Any = getattr(bridge, "sync_obj_conf")  # noqa: B009 - the name bridge.py calls

    def conf(*args: Any, **kw: Any) -> Any:
        c = shipped(*args, **kw)
        c.raftMinTimeout, c.raftMaxTimeout, c.leaderFallbackTimeout = election_min, election_max, fallback
        c.connectionTimeout = max(c.connectionTimeout, election_max)  # (pysyncobj requires it)
        return c

    setattr(bridge, "sync_obj_conf", conf)  # noqa: B010
    sys.stderr.write(json.dumps({"event": "bench override: raft timeouts", "election_min": election_min,
                                 "election_max": election_max, "leader_fallback": fallback}) + "\n")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--control"]:
        probe("control")
        return 0
    threading.Thread(target=probe, args=("in-process",), daemon=True, name="stall-probe").start()
    timeouts = os.environ.get("BENCH_RAFT_TIMEOUTS", "")
    if timeouts:
        _override_raft_timeouts(*(float(x) for x in timeouts.split(",")))
    from bigfleet.cli.main import main as bigfleet_main

    return bigfleet_main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
