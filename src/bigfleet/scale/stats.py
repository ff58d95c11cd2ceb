"""Pure helpers for the report: sample quantiles, Prometheus text parsing and window deltas."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile (the value at or above ``q`` of the sorted samples); NaN if empty."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def parse(text: str) -> Samples:
    """Prometheus exposition text as ``(sample name, sorted labels) -> value``."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    """Sum over samples named ``name`` whose labels include ``labels``, after minus before."""
    want = set(labels.items())
    total = 0.0
    for (n, lab), v in after.items():
        if n == name and want <= set(lab):
            total += v - before.get((n, lab), 0.0)
    return total


def histogram_quantile(after: Samples, before: Samples, name: str, q: float, **labels: str) -> float:
    """Upper bound of the bucket holding quantile ``q`` of the observations made in the window.

    Histogram buckets bound the true value from above; the report says "≤" for these.
    """
    want = set(labels.items())
    per_le: dict[float, float] = {}
    for (n, lab), v in after.items():
        if n != name + "_bucket":
            continue
        d = dict(lab)
        le = d.pop("le", None)
        if le is None or not want <= set(d.items()):
            continue
        bound = math.inf if le == "+Inf" else float(le)
        per_le[bound] = per_le.get(bound, 0.0) + v - before.get((n, lab), 0.0)
    if not per_le:
        return math.nan
    bounds = sorted(per_le)
    total = per_le[bounds[-1]]
    if total <= 0:
        return math.nan
    for b in bounds:
        if per_le[b] >= q * total:
            return b
    return math.inf


def label_values(samples: Samples, name: str, label: str) -> list[str]:
    return sorted({dict(lab)[label] for (n, lab) in samples if n == name and label in dict(lab)})


def per_cycle_peaks(series: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """From (cycles, binds) counter readings taken over time: (max, mean) binds per cycle.

    Only intervals in which exactly one cycle completed give an exact per-cycle figure; the
    others are averaged over their cycles (a lower bound for the peak).
    """
    best, per = 0.0, []
    for (c0, b0), (c1, b1) in itertools.pairwise(series):
        dc = c1 - c0
        if dc <= 0:
            continue
        v = (b1 - b0) / dc
        per.append(v)
        best = max(best, v)
    return best, (sum(per) / len(per) if per else 0.0)
