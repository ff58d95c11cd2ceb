"""Raft write failures as one exception type, with pysyncobj's numeric reasons named."""

from __future__ import annotations

from typing import Any

from pysyncobj import FAIL_REASON


class RaftError(Exception):
    """A write did not commit (not leader, no quorum, timeout, or another pysyncobj failure).

    Every replicated command in BigFleet is idempotent, so callers answer this by retrying
    (or by telling their client to retry) rather than by guessing whether it applied.
    """


_REASONS = {v: k for k, v in vars(FAIL_REASON).items() if not k.startswith("_") and isinstance(v, int)}


def fail_reason(err: Any) -> str:
    """pysyncobj reports failures as bare ints; a name makes the log line readable."""
    return str(_REASONS.get(err, err))
