"""Helpers for tests that run real daemons as separate processes on loopback."""

from bigfleet.testing.procs import ManagedProcess, free_port, wait_for_health, wait_until

__all__ = ["ManagedProcess", "free_port", "wait_for_health", "wait_until"]
