"""Normalisation: fold Same gangs whose whole aggregate fits on one machine into plain needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

from bigfleet.needs import Need, Operator, Profile, Requirement, Resources

from .index import (
    CONFIGURED,
    CONFIGURING,
    Index,
)
from .scratch import NeedRow, RowMaker

_SAME_OF: Callable[[Profile], Requirement | None] = attrgetter("same")


def _strip_same(p: Profile) -> Profile:
    return Profile(
        tuple(r for r in p.requirements if r.operator is not Operator.SAME),
        p.spread,
        p.priority,
        p.interruption_bucket,
        p.reclamation_bucket,
        "",
    )


def normalize(needs: Sequence[Need], ix: Index, free_classes: set[int] | None = None
              ) -> tuple[list[tuple[Need, list[Need]]], int]:
    """Fold Same needs whose whole aggregate fits on one machine into plain needs.

    See `normalize_rows` (which also says whether the free pool decided any fold).
    """
    out, folded, _ = normalize_rows(needs, ix, free_classes)
    return out, folded


class FoldMemo:
    """What folding derives from a gang's profile alone, shared by every cluster of a cycle: an id
    for its requirement tuple (hashing one is a Python call per requirement) and its Same-less
    profile (a new fingerprint: JSON and SHA-256)."""

    def __init__(self) -> None:
        self.by_fp: dict[str, tuple[int, Profile]] = {}
        self._reqs_ids: dict[tuple[Requirement, ...], int] = {}
        self._stripped: dict[tuple[Any, ...], Profile] = {}

    def of(self, p: Profile) -> tuple[int, Profile]:
        got = self.by_fp.get(p._fingerprint)
        if got is None:
            rid = self._reqs_ids.setdefault(p.requirements, len(self._reqs_ids))
            sk = (p.requirements, p.spread, p.priority, p.interruption_bucket, p.reclamation_bucket)
            sp = self._stripped.get(sk)
            if sp is None:
                sp = self._stripped[sk] = _strip_same(p)
            got = self.by_fp[p._fingerprint] = (rid, sp)
        return got


def normalize_rows(needs: Sequence[Need], ix: Index, free_classes: set[int] | None = None,
                   same_of: Callable[[Profile], Requirement | None] | None = None, fold: FoldMemo | None = None
                   ) -> tuple[list[tuple[Need, list[Need]]], int, bool]:
    """Fold Same needs whose whole aggregate fits on one machine into plain needs.

    A gang that fits on one machine cannot be split across domains, so co-location is automatic;
    folding keeps the machine-exclusive claim ledger honest (two sub-machine gangs share one
    machine instead of each claiming one). A gang is foldable when some machine matching its
    profile covers the whole aggregate: one of its own cluster's bound machines, or any Idle or
    Speculative machine. Returns (need, original members) rows, the count of folded gangs, and
    whether any fold decision depended on the free pool (no own bound class settled it): only
    then does a cached result of these needs go stale when the free pool changes. `same_of` (the
    profile's Same requirement) and `fold` are the caller's per-cycle memos.
    """
    out: list[tuple[Need, list[Need]]] = []
    groups: dict[tuple[str, str, tuple[tuple[str, int], ...]], tuple[Profile, Resources, list[Need]]] = {}
    if free_classes is None:
        free_classes = {ci for (_st, ci) in ix.pool}
    if fold is None:
        fold = FoldMemo()
    own_memo: dict[str, set[int]] = {}
    memo: dict[tuple[str, int, tuple[tuple[str, int], ...]], bool] = {}
    folded = 0
    free_dependent = False
    if same_of is None:
        same_of = _SAME_OF
    for n in needs:
        p = n.profile
        agg = n.aggregate_resources
        if same_of(p) is None or agg.is_zero():
            out.append((n, [n]))
            continue
        rid, sp = fold.of(p)
        items = agg._items  # (equal vectors have equal items: a C-level hash instead of a Python one)
        mk = (n.cluster_id, rid, items)
        ok = memo.get(mk)
        if ok is None:
            ok = False
            own_classes = own_memo.get(n.cluster_id)
            if own_classes is None:
                own = ix.bound.get(n.cluster_id, {})
                own_classes = set(own.get(CONFIGURED, {})) | set(own.get(CONFIGURING, {}))
                own_memo[n.cluster_id] = own_classes
            fitting = [c.idx for c in ix.matched_classes(p.requirements) if agg.fits_in(c.alloc)]
            if any(ci in own_classes for ci in fitting):
                ok = True
            else:
                free_dependent = True
                ok = any(ci in free_classes for ci in fitting)
            memo[mk] = ok
        if not ok:
            out.append((n, [n]))
            continue
        gk = (n.cluster_id, sp._fingerprint, items)
        g = groups.get(gk)
        if g is None:
            groups[gk] = (sp, agg, [n])
        else:
            g[2].append(n)
        folded += 1
    for gk in sorted(groups):
        sp, agg, members = groups[gk]
        minu = agg
        for mu in {m.min_unit._items: m.min_unit for m in members}.values():  # (max is order-free)
            minu = minu.max(mu)
        arrivals = [m.arrival_unix_nanos for m in members if m.arrival_unix_nanos]
        out.append((Need(gk[0], sp, agg.scale(len(members)), minu, min(arrivals) if arrivals else 0), members))
    return out, folded, free_dependent


def cluster_rows(maker: RowMaker, needs: Sequence[Need], ix: Index, free_classes: set[int], fold: FoldMemo
                 ) -> tuple[list[NeedRow], int, bool]:
    """`normalize_rows` and the cluster's `NeedRow`s. A cluster without Same needs (most) folds
    nothing: its rows are built straight from the needs, in one pass with their profile lookups."""
    rows = maker.plain_rows(needs)
    if rows is not None:
        return rows, 0, False
    raw, folded, free_dep = normalize_rows(needs, ix, free_classes, maker.same_of, fold)
    return maker.rows(raw), folded, free_dep
