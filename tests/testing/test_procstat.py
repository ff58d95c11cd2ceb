"""The /proc readers the benchmarks and the scale harness measure daemons with."""

from __future__ import annotations

import os
import subprocess
import sys

from bigfleet.process.procstat import (
    proc_children,
    proc_cpu_seconds,
    proc_rss_mb,
    tree_cpu_seconds,
    tree_rss_mb,
)
from bigfleet.testing import wait_until


def test_reads_this_process_and_counts_a_child_in_the_tree() -> None:
    me = os.getpid()
    assert proc_rss_mb(me) > 10  # an interpreter with pytest loaded
    assert proc_cpu_seconds(me) > 0
    child = subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(64 << 20); time.sleep(30)"])
    try:
        wait_until(lambda: proc_rss_mb(child.pid) > 64, 10, what="the child's 64 MiB resident")
        assert child.pid in proc_children(me)
        assert tree_rss_mb(me) >= proc_rss_mb(me) + 64
        assert tree_cpu_seconds(me) >= proc_cpu_seconds(me)
    finally:
        child.kill()
        child.wait()
    assert proc_rss_mb(child.pid) == 0.0  # gone: no error, nothing counted
    assert child.pid not in proc_children(me)
