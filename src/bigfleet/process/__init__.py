"""Real daemons as child processes on loopback: free ports, start/stop/kill, wait on conditions,
and their CPU and memory read from /proc (`bigfleet.process.procstat`).

Used by the all-in-one fleet, the scale harness, the provider conformance runner and (through the
`bigfleet.process` re-export) the tests and benchmarks.
"""

from bigfleet.process.procs import ManagedProcess, free_port, wait_for_health, wait_until, wait_until_async

__all__ = ["ManagedProcess", "free_port", "wait_for_health", "wait_until", "wait_until_async"]
