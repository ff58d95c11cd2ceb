"""Immutable, hashable label mappings and the interner that shares them between machines.

Half a million machines come in a few hundred shapes; sharing one `Labels`, one `Resources` and one
shape object per distinct value keeps a machine record to a handful of pointers.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

_setattr = object.__setattr__


class Labels(Mapping[str, str]):
    """A frozen ``{key: value}`` with a precomputed hash (usable as a dict key and shareable)."""

    __slots__ = ("_hash", "_items", "_map")

    _items: tuple[tuple[str, str], ...]
    _map: dict[str, str]
    _hash: int

    def __init__(self, labels: Mapping[str, str] | None = None) -> None:
        items = tuple(sorted((labels or {}).items()))
        _setattr(self, "_items", items)
        _setattr(self, "_map", dict(items))
        _setattr(self, "_hash", hash(items))

    def __getitem__(self, key: str) -> str:
        return self._map[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._map.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if isinstance(other, Labels):
            return self._hash == other._hash and self._items == other._items
        if isinstance(other, Mapping):
            return self._map == dict(other.items())
        return NotImplemented

    def pairs(self) -> tuple[tuple[str, str], ...]:
        """Sorted ``(key, value)`` pairs."""
        return self._items

    def to_dict(self) -> dict[str, str]:
        return dict(self._items)

    def with_items(self, extra: Mapping[str, str]) -> Labels:
        """A copy with `extra` merged over it."""
        m = dict(self._items)
        m.update(extra)
        return Labels(m)

    def __repr__(self) -> str:
        return f"Labels({dict(self._items)!r})"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Labels is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        return (Labels, (dict(self._items),))


EMPTY_LABELS = Labels()

T = TypeVar("T")


class Interner:
    """Canonical instances for equal values (labels, resources, shapes, strings, floats).

    Purely a memory optimisation: correctness never depends on identity. Each table is cleared
    when it passes `max_entries`, so a stream of unique values cannot grow it without bound.
    """

    __slots__ = ("_tables", "max_entries")

    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self._tables: dict[str, dict[Any, Any]] = {}

    def intern(self, kind: str, value: T) -> T:
        table = self._tables.get(kind)
        if table is None:
            table = self._tables[kind] = {}
        hit = table.get(value)
        if hit is not None:
            return hit  # type: ignore[no-any-return]
        if len(table) >= self.max_entries:
            table.clear()
        table[value] = value
        return value

    def lookup(self, kind: str, key: Any) -> Any:
        """The value remembered under `key` (None if absent); pairs with `remember`."""
        table = self._tables.get(kind)
        return None if table is None else table.get(key)

    def remember(self, kind: str, key: Any, value: Any) -> None:
        table = self._tables.get(kind)
        if table is None:
            table = self._tables[kind] = {}
        if len(table) >= self.max_entries:
            table.clear()
        table[key] = value

    def string(self, s: str) -> str:
        return sys.intern(s) if s else ""

    def labels(self, labels: Mapping[str, str] | None) -> Labels:
        if not labels:
            return EMPTY_LABELS
        lab = labels if isinstance(labels, Labels) else Labels({sys.intern(k): sys.intern(v) for k, v in labels.items()})
        return self.intern("labels", lab)

    def sizes(self) -> dict[str, int]:
        return {k: len(v) for k, v in self._tables.items()}


#: The process-wide interner `Machine` construction uses unless given another.
DEFAULT_INTERNER = Interner()
