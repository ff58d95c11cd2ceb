"""Node-selector requirements (plus the wire-only Same operator) and topology spread terms."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum

# Kubernetes limits: label keys are an optional 253-character DNS prefix, '/', and a 63-character
# name; label values are at most 63 characters.
MAX_LABEL_KEY_LEN = 317
MAX_LABEL_VALUE_LEN = 63

_setattr = object.__setattr__


class Operator(IntEnum):
    """`NodeSelectorRequirement.Operator` values on the wire."""

    UNSPECIFIED = 0
    IN = 1
    NOT_IN = 2
    EXISTS = 3
    DOES_NOT_EXIST = 4
    SAME = 5

    @property
    def k8s_name(self) -> str:
        """The string form the operator's bootstrap renderer and the CRDs use (``In``, ``NotIn``...)."""
        return _K8S_NAMES[self]

    @classmethod
    def from_k8s_name(cls, name: str) -> Operator:
        """``In``/``NotIn``/``Exists``/``DoesNotExist``/``Same`` → Operator (``ValueError`` otherwise)."""
        for op, n in _K8S_NAMES.items():
            if n == name and op is not Operator.UNSPECIFIED:
                return op
        raise ValueError(f"unknown operator {name!r}")


_K8S_NAMES = {
    Operator.UNSPECIFIED: "",
    Operator.IN: "In",
    Operator.NOT_IN: "NotIn",
    Operator.EXISTS: "Exists",
    Operator.DOES_NOT_EXIST: "DoesNotExist",
    Operator.SAME: "Same",
}


class WhenUnsatisfiable(IntEnum):
    """`TopologySpread.WhenUnsatisfiable` values on the wire."""

    UNSPECIFIED = 0
    DO_NOT_SCHEDULE = 1
    SCHEDULE_ANYWAY = 2


@dataclass(frozen=True, slots=True)
class Requirement:
    """One constraint on a machine label. `values` is canonical: sorted and de-duplicated.

    Order of values carries no meaning (they are a set), so construction canonicalises them; two
    requirements built from the same set in different orders are equal and hash equal.
    """

    key: str
    operator: Operator
    values: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        vals = self.values
        canon = tuple(sorted(set(vals)))
        if canon != vals:
            _setattr(self, "values", canon)
        if type(self.operator) is not Operator:
            _setattr(self, "operator", Operator(self.operator))

    @classmethod
    def of(cls, key: str, operator: Operator | int, values: Iterable[str] = ()) -> Requirement:
        return cls(key, Operator(operator), tuple(values))

    def matches_value(self, value: str | None) -> bool:
        """Whether a machine whose label `key` is `value` (None: absent) passes this requirement."""
        op = self.operator
        if op is Operator.IN:
            return value is not None and value in self.values
        if op is Operator.NOT_IN:
            return value is None or value not in self.values
        if op is Operator.EXISTS:
            return value is not None
        if op is Operator.DOES_NOT_EXIST:
            return value is None
        if op is Operator.SAME:
            # Co-location across the gang is the engine's job; per machine, the key must exist and,
            # when values are given, hold one of them.
            return value is not None and (not self.values or value in self.values)
        return False  # UNSPECIFIED never matches

    def matches(self, labels: Mapping[str, str]) -> bool:
        return self.matches_value(labels.get(self.key))

    def sort_key(self) -> tuple[str, int, tuple[str, ...]]:
        return (self.key, int(self.operator), self.values)


@dataclass(frozen=True, slots=True)
class TopologySpread:
    """The engine-visible part of a pod topologySpreadConstraint. ``max_skew < 1`` is treated as 1."""

    topology_key: str
    max_skew: int = 1
    when_unsatisfiable: WhenUnsatisfiable = WhenUnsatisfiable.DO_NOT_SCHEDULE

    def __post_init__(self) -> None:
        if self.max_skew < 1:
            _setattr(self, "max_skew", 1)
        if type(self.when_unsatisfiable) is not WhenUnsatisfiable:
            _setattr(self, "when_unsatisfiable", WhenUnsatisfiable(self.when_unsatisfiable))

    @property
    def strict(self) -> bool:
        """Only DoNotSchedule terms are enforced; ScheduleAnyway is left to cheapest-first order."""
        return self.when_unsatisfiable is WhenUnsatisfiable.DO_NOT_SCHEDULE

    def sort_key(self) -> tuple[str, int, int]:
        return (self.topology_key, self.max_skew, int(self.when_unsatisfiable))


def matches_all(requirements: Iterable[Requirement], labels: Mapping[str, str]) -> bool:
    """True iff every requirement passes for `labels` (an empty list always matches)."""
    return all(r.matches(labels) for r in requirements)

