"""Build frozen dataclass records without their per-field ``object.__setattr__`` calls.

Hot paths emit tens of thousands of actions and verdicts per cycle; equality, hash and repr of
what is built are unchanged (`fields` must name every field).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from bigfleet.machine.record import Machine

from .types import Action, Configure, Create

_T = TypeVar("_T")


def build_each(cls: type[Configure] | type[Create], machines: list[Machine], fields: Mapping[str, object],
               out: list[Action]) -> None:
    """One record per machine, equal but for ``machine_id`` (the Phase-1 binds of one need)."""
    new = object.__new__
    for m in machines:
        obj = new(cls)
        d = obj.__dict__
        d.update(fields)
        d["machine_id"] = m.id
        out.append(obj)


def build_fast(cls: type[_T], fields: Mapping[str, object]) -> _T:
    """One record of `cls` from `fields`."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj
