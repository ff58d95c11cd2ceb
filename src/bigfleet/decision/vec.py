"""Resource vectors: one int (milli-units) per dimension of the cycle, in a fixed dimension order.

Plain tuples and list comprehensions: the phases do millions of these per cycle.
"""

from __future__ import annotations

from bigfleet.needs import Resources

Vec = tuple[int, ...]


def vsub(a: Vec, b: Vec) -> Vec:
    return tuple([x - y if x > y else 0 for x, y in zip(a, b, strict=False)])


def covers(have: Vec, want: Vec) -> bool:
    for h, w in zip(have, want, strict=False):  # noqa: SIM110 - an explicit loop is faster
        if h < w:
            return False
    return True


def vadd(a: Vec, b: Vec) -> Vec:
    return tuple([x + y for x, y in zip(a, b, strict=False)])


def units_to_cover(rem: Vec, unit: Vec, limit: int) -> int:
    """How many machines of allocatable `unit` (at most `limit`) it takes to cover `rem`."""
    need = 0
    for r, u in zip(rem, unit, strict=False):
        if r > 0:
            if u <= 0:
                return limit
            k = -(-r // u)
            if k > need:
                need = k
    return min(need, limit)


def to_resources(dims: tuple[str, ...], v: Vec) -> Resources:
    return Resources.from_milli({d: x for d, x in zip(dims, v, strict=False) if x})
