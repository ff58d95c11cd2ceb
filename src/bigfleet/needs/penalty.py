"""Penalty buckets: dollars quantised up to powers of two so that similar workloads aggregate.

Bucket values are the proto enum values, so they are ordered by dollars already; PINNED (27) means
"never interrupt / never reclaim" and sorts after every finite bucket. Nothing here produces NaN.
"""

from __future__ import annotations

import math
from enum import IntEnum

from bigfleet.needs.errors import ValidationError


class PenaltyBucket(IntEnum):
    """The `PenaltyBucket` proto enum; ``B<n>`` is the bucket whose upper bound is $n."""

    UNSPECIFIED = 0
    ZERO = 1
    HALF_DOLLAR = 2
    B1 = 3
    B2 = 4
    B4 = 5
    B8 = 6
    B16 = 7
    B32 = 8
    B64 = 9
    B128 = 10
    B256 = 11
    B512 = 12
    B1024 = 13
    B2048 = 14
    B4096 = 15
    B8192 = 16
    B16384 = 17
    B32768 = 18
    B65536 = 19
    B131072 = 20
    B262144 = 21
    B524288 = 22
    B1048576 = 23
    B2097152 = 24
    B4194304 = 25
    B8388608 = 26
    PINNED = 27

    @property
    def label(self) -> str:
        """Metric label: ``"0"``, ``"0.5"``, ``"1"`` … ``"8388608"``, ``"pinned"``, ``"unspecified"``."""
        if self is PenaltyBucket.UNSPECIFIED:
            return "unspecified"
        if self is PenaltyBucket.PINNED:
            return "pinned"
        if self is PenaltyBucket.ZERO:
            return "0"
        if self is PenaltyBucket.HALF_DOLLAR:
            return "0.5"
        return str(1 << (self - 3))


#: Largest finite bound in dollars; anything above is PINNED.
MAX_FINITE_DOLLARS = float(1 << 23)


def bucket_from_dollars(dollars: float, field: str = "") -> PenaltyBucket:
    """Round `dollars` UP to the smallest bucket bound ≥ it (0 → ZERO, > $8 388 608 → PINNED).

    Raises ``ValidationError`` for NaN or a negative amount (a penalty is never a reward).
    """
    x = float(dollars)
    if math.isnan(x):
        raise ValidationError(field, "penalty is NaN")
    if x < 0:
        raise ValidationError(field, f"negative penalty {x!r}")
    if x == 0:
        return PenaltyBucket.ZERO
    if x <= 0.5:
        return PenaltyBucket.HALF_DOLLAR
    if x > MAX_FINITE_DOLLARS:
        return PenaltyBucket.PINNED
    # smallest k with 2**k >= x, k in 0..23; frexp gives x = m * 2**e with 0.5 <= m < 1.
    m, e = math.frexp(x)
    k = e - 1 if m == 0.5 else e
    return PenaltyBucket(3 + max(k, 0))


def bucket_dollars(bucket: PenaltyBucket | int) -> float:
    """The bucket's upper bound in dollars (deliberately an overestimate); PINNED → inf, UNSPECIFIED → 0."""
    b = int(bucket)
    if b <= 1:
        if b < 0:
            raise ValueError(f"unknown penalty bucket {b}")
        return 0.0
    if b == 2:
        return 0.5
    if b >= 27:
        if b > 27:
            raise ValueError(f"unknown penalty bucket {b}")
        return math.inf
    return float(1 << (b - 3))


def penalty_sort_key(bucket: PenaltyBucket | int) -> int:
    """Total order for penalties: UNSPECIFIED and ZERO tie at the bottom, PINNED above every finite one."""
    b = int(bucket)
    return 1 if b <= 1 else b


def dollars_sort_key(dollars: float) -> float:
    """A NaN-free sort key for a dollar amount (NaN is treated as 0, inf stays last)."""
    return 0.0 if math.isnan(dollars) else dollars
