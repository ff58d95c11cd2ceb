"""`Resources`: an immutable, hashable resource vector in integer milli-units.

The decision engine compares vectors millions of times per cycle and holds one per machine shape, so
the type is tuple-backed (sorted ``(name, milli)`` pairs, zero dimensions dropped so equal vectors are
equal objects), keeps a dict beside it for O(1) lookups and precomputes its hash.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from bigfleet.needs.errors import ValidationError
from bigfleet.needs.quantity import MAX_MILLI, format_quantity, parse_quantity

_setattr = object.__setattr__

# Longest resource name accepted (k8s: 253-character DNS prefix + '/' + 63-character name).
MAX_RESOURCE_NAME_LEN = 317
# Most dimensions one vector may carry on the wire.
MAX_DIMENSIONS = 64


_GOOD_NAMES: set[str] = set()
# Parsed wire vectors by their items; like the quantity cache, bounded and purely a speed-up.
_PARSED: dict[tuple[tuple[str, str], ...], Resources] = {}
_CACHE_MAX = 8192


def _check_name(name: object, field: str) -> str:
    if isinstance(name, str) and name in _GOOD_NAMES:
        return name
    if not isinstance(name, str) or not name:
        raise ValidationError(field, "empty resource name")
    if len(name) > MAX_RESOURCE_NAME_LEN:
        raise ValidationError(field, f"resource name longer than {MAX_RESOURCE_NAME_LEN} characters")
    if any(c.isspace() for c in name) or not name.isprintable():
        raise ValidationError(field, f"resource name {name!r} contains whitespace or control characters")
    if len(_GOOD_NAMES) < _CACHE_MAX:
        _GOOD_NAMES.add(name)
    return name


class Resources:
    """Immutable {resource name → milli-units}; a missing dimension is 0 and values are never negative."""

    __slots__ = ("_hash", "_items", "_map")

    _items: tuple[tuple[str, int], ...]
    _map: dict[str, int]
    _hash: int

    def __init__(self, milli: Mapping[str, int] | Iterable[tuple[str, int]] = ()) -> None:
        pairs = milli.items() if isinstance(milli, Mapping) else milli
        m: dict[str, int] = {}
        for name, value in pairs:
            if not isinstance(name, str) or not name:
                raise ValueError(f"bad resource name {name!r}")
            if type(value) is not int:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"resource {name!r}: milli-units must be int, got {type(value).__name__}")
                value = int(value)
            if value < 0:
                raise ValueError(f"resource {name!r}: negative quantity {value}")
            if value > MAX_MILLI:
                raise ValueError(f"resource {name!r}: quantity {value} out of range")
            if value:
                m[name] = m.get(name, 0) + value
        self._set(tuple(sorted(m.items())))

    def _set(self, items: tuple[tuple[str, int], ...]) -> None:
        _setattr(self, "_items", items)
        _setattr(self, "_map", dict(items))
        _setattr(self, "_hash", hash(items))

    @classmethod
    def _trusted(cls, items: tuple[tuple[str, int], ...]) -> Resources:
        """Build from already sorted, positive, de-duplicated pairs (internal fast path)."""
        r = object.__new__(cls)
        r._set(items)
        return r

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def from_milli(cls, milli: Mapping[str, int]) -> Resources:
        """From integer milli-units (``{"cpu": 500}`` is half a cpu)."""
        return cls(milli)

    @classmethod
    def parse(cls, wire: Mapping[str, str], field: str = "") -> Resources:
        """From Kubernetes quantity strings (``{"cpu": "500m", "memory": "2Gi"}``), validating everything.

        Raises ``ValidationError`` naming ``field["name"]`` for a bad name, a malformed or negative
        quantity, or too many dimensions.
        """
        if len(wire) > MAX_DIMENSIONS:
            raise ValidationError(field, f"more than {MAX_DIMENSIONS} resource dimensions")
        key = tuple(wire.items())
        hit = _PARSED.get(key)
        if hit is not None:
            return hit
        m: dict[str, int] = {}
        for name, text in wire.items():
            sub = f'{field}["{name}"]' if isinstance(name, str) else field
            _check_name(name, sub)
            v = parse_quantity(text, sub)
            if v < 0:
                raise ValidationError(sub, f"negative quantity {text!r}")
            if v:
                m[name] = v
        r = cls._trusted(tuple(sorted(m.items())))
        if len(_PARSED) >= _CACHE_MAX:
            _PARSED.clear()
        _PARSED[key] = r
        return r

    def to_wire(self) -> dict[str, str]:
        """Canonical Kubernetes quantity strings (zero dimensions are omitted)."""
        return {name: format_quantity(v) for name, v in self._items}

    def to_milli(self) -> dict[str, int]:
        return dict(self._items)

    # --- reading -------------------------------------------------------------------------------

    def get(self, name: str) -> int:
        """Milli-units of `name` (0 when absent)."""
        return self._map.get(name, 0)

    def items(self) -> tuple[tuple[str, int], ...]:
        """``(name, milli)`` pairs sorted by name, non-zero only."""
        return self._items

    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self._items)

    def is_zero(self) -> bool:
        return not self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[str]:
        return (n for n, _ in self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._map

    def __bool__(self) -> bool:
        return bool(self._items)

    # --- arithmetic ----------------------------------------------------------------------------

    def __add__(self, other: Resources) -> Resources:
        if not isinstance(other, Resources):
            return NotImplemented
        if not other._items:
            return self
        if not self._items:
            return other
        m = dict(self._map)
        for name, v in other._items:
            m[name] = m.get(name, 0) + v
        return Resources._trusted(tuple(sorted(m.items())))

    def __sub__(self, other: Resources) -> Resources:
        """Exact difference; raises ``ValueError`` if any dimension would go negative."""
        if not isinstance(other, Resources):
            return NotImplemented
        if not other._items:
            return self
        m = dict(self._map)
        for name, v in other._items:
            left = m.get(name, 0) - v
            if left < 0:
                raise ValueError(f"resource {name!r} would go negative ({left}); use saturating_sub()")
            if left:
                m[name] = left
            else:
                m.pop(name, None)
        return Resources._trusted(tuple(sorted(m.items())))

    def saturating_sub(self, other: Resources) -> Resources:
        """Per-dimension difference floored at 0 (the deficit left after `other` is credited)."""
        if not other._items:
            return self
        om = other._map
        return Resources._trusted(tuple((n, v - om.get(n, 0)) for n, v in self._items if v > om.get(n, 0)))

    sub_floor0 = saturating_sub

    def max(self, other: Resources) -> Resources:
        """Per-dimension maximum (folds per-pod units into a need's ``min_unit``)."""
        if not other._items or self is other:
            return self
        if not self._items:
            return other
        m = dict(self._map)
        for name, v in other._items:
            if v > m.get(name, 0):
                m[name] = v
        return Resources._trusted(tuple(sorted(m.items())))

    def min(self, other: Resources) -> Resources:
        """Per-dimension minimum."""
        om = other._map
        return Resources._trusted(tuple((n, min(v, om[n])) for n, v in self._items if n in om))

    def scale(self, k: int) -> Resources:
        """Every dimension times `k`; ``k <= 0`` gives the empty vector."""
        if k <= 0 or not self._items:
            return EMPTY
        if k == 1:
            return self
        return Resources._trusted(tuple((n, v * k) for n, v in self._items))

    def fits_in(self, other: Resources) -> bool:
        """True iff every dimension of self is ≤ the same dimension of `other`."""
        om = other._map
        for name, v in self._items:  # noqa: SIM110 - explicit loop is faster than all() on the hot path
            if v > om.get(name, 0):
                return False
        return True

    def covers(self, want: Resources) -> bool:
        """True iff self has at least `want` in every dimension (``want.fits_in(self)``)."""
        return want.fits_in(self)

    def times_fits(self, unit: Resources) -> int:
        """How many whole copies of `unit` fit in self (a large number when `unit` is zero)."""
        if not unit._items:
            return MAX_MILLI
        sm = self._map
        return min(sm.get(n, 0) // v for n, v in unit._items)

    # --- identity ------------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Resources):
            return NotImplemented
        return self._hash == other._hash and self._items == other._items

    def __hash__(self) -> int:
        return self._hash

    def __lt__(self, other: Resources) -> bool:
        """An arbitrary but total order (by sorted pairs) so vectors can be sort keys."""
        return self._items < other._items

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={format_quantity(v)}" for n, v in self._items)
        return f"Resources({inner})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Resources._trusted, (self._items,))

    def __setattr__(self, name: str, value: object) -> None:
        if hasattr(self, "_hash"):
            raise AttributeError("Resources is immutable")
        object.__setattr__(self, name, value)


EMPTY = Resources()
