"""CPU and memory of other processes, read from /proc (benchmarks and the scale harness measure
the daemons they start from outside, as an operator's tooling would)."""

from __future__ import annotations

import os

CLK = os.sysconf("SC_CLK_TCK")


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / CLK


def proc_rss_mb(pid: int) -> float:
    """Resident set size in MiB (0 for a process that is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def proc_children(pid: int) -> list[int]:
    """Direct children (e.g. the shard's engine worker process)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
    except OSError:
        pass
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU of the process and its live children (a worker process's CPU counts for the shard)."""
    total = 0.0
    for p in (pid, *proc_children(pid)):
        try:
            total += proc_cpu_seconds(p)
        except OSError:
            pass
    return total


def tree_rss_mb(pid: int) -> float:
    """RSS of the process and its live children."""
    return sum(proc_rss_mb(p) for p in (pid, *proc_children(pid)))
