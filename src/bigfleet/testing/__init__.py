"""Helpers for tests that run real daemons as separate processes on loopback.

The process helpers themselves live in :mod:`bigfleet.process` (the all-in-one fleet, the scale
harness and the conformance runner use them too); this package re-exports them for tests and
benchmarks. Production code must not import ``bigfleet.testing`` (an import-linter contract, see
docs/architecture.md).
"""

from bigfleet.process import ManagedProcess, free_port, wait_for_health, wait_until, wait_until_async

__all__ = ["ManagedProcess", "free_port", "wait_for_health", "wait_until", "wait_until_async"]
