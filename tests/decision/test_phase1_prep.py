"""Phase-1 preparation and acquisition fast paths equal their plain versions: rows built from the
per-fingerprint memos equal rows built need by need; the plan memo, the inlined group picks, the
credit-pass skip and the cycle-wide fold memo decide exactly as the one-need-at-a-time code."""

from __future__ import annotations

from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bigfleet.decision import EngineConfig, EngineState, cycle, decide
from bigfleet.decision.acquire import next_in_group, ordered_classes
from bigfleet.decision.credit import credit_plain
from bigfleet.decision.index import IDLE, SPEC, build_index
from bigfleet.decision.normalise import FoldMemo, cluster_rows, normalize_rows
from bigfleet.decision.same_domain import credit_same
from bigfleet.decision.scratch import CycleScratch, NeedRow, RowMaker
from bigfleet.decision.vec import vsub
from bigfleet.machine import Inventory, Machine, MachineState
from bigfleet.needs import Need, Operator
from bigfleet.needs.penalty import bucket_dollars

from .fx import NOW, machine
from .test_engine_properties import CLUSTERS, g, machines, needs

S = MachineState
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
_FIELDS = ("cluster", "fp", "reqs", "prio", "ib", "rb", "group", "same", "spreads", "agg", "minu", "arrival",
           "key", "remaining", "p1_remaining", "freed")


def _reference_fields(nd: Need, dims: tuple[str, ...]) -> dict[str, object]:
    """A row's fields computed straight from its need (what `NeedRow` did before the memos)."""
    p = nd.profile
    same = next((r for r in p.requirements if r.operator is Operator.SAME), None)
    ib, rb = int(p.interruption_bucket), int(p.reclamation_bucket)
    agg = tuple(nd.aggregate_resources._map.get(d, 0) for d in dims)
    fp = p.fingerprint()
    return {
        "cluster": nd.cluster_id, "fp": fp, "reqs": p.requirements, "prio": int(p.priority), "ib": ib, "rb": rb,
        "group": p.group, "same": same, "spreads": tuple(s for s in p.spread if s.strict) if same is None else (),
        "agg": agg, "minu": tuple(nd.min_unit._map.get(d, 0) for d in dims), "arrival": nd.arrival_unix_nanos,
        "order": (-int(p.priority), -max(ib, 1), -max(rb, 1), nd.arrival_unix_nanos, nd.cluster_id, fp),
        "key": nd.cluster_id + "\x00" + fp, "remaining": agg, "p1_remaining": agg, "freed": (0,) * len(dims),
    }


@SETTINGS
@given(machines(), needs(), needs())
def test_rows_from_memos_equal_rows_built_need_by_need(ms: list[Machine], ns1: list[Need], ns2: list[Need]) -> None:
    ix = build_index(ms)
    dims = ("cpu", "memory", "nvidia.com/gpu")
    maker, fold = RowMaker(dims), FoldMemo()
    free = {ci for (_st, ci) in ix.pool}
    for ns in (ns1, ns2, ns1):  # the memos are shared by every cluster of a cycle
        orders: list[tuple[str, tuple[object, ...]]] = []
        for c in CLUSTERS:
            cn = [n for n in ns if n.cluster_id == c]
            rows, folded, dep = cluster_rows(maker, cn, ix, free, fold)
            raw, folded_ref, dep_ref = normalize_rows(cn, ix, free)
            assert (folded, dep) == (folded_ref, dep_ref)
            assert [(r.need, r.members) for r in rows] == raw
            for r, (nd, _members) in zip(rows, raw, strict=True):
                ref = _reference_fields(nd, dims)
                assert {f: getattr(r, f) for f in _FIELDS} == {f: ref[f] for f in _FIELDS}
                assert r.park_key == ("" if r.same is None else r.cluster + "\x00" + r.group + "\x00" + r.fp)
                orders.append((r.order, ref["order"]))
        # the order string sorts (and ties) exactly as the precedence tuple
        by_str = sorted(orders, key=lambda o: o[0])
        assert [o[1] for o in by_str] == sorted(o[1] for o in orders)
        assert len({o[0] for o in orders}) == len({o[1] for o in orders})


def _reference_take(cy: CycleScratch, n: NeedRow, classes: list, penalty: float) -> None:
    """The one-machine-at-a-time acquisition (`next_in_group` + `take` per pick, no plan memo)."""
    from bigfleet.decision.acquire import _bulk_take

    for state in (IDLE, SPEC):
        for group in ordered_classes(cy, classes, state, penalty):
            if len(group) == 1:
                _bulk_take(cy, n, state, group[0])
            while len(group) > 1 and any(n.remaining):
                nxt = next_in_group(cy, state, group)
                if nxt is None:
                    break
                c, m = nxt
                cy.take(m, n, (state, c.idx))
                (n.acquired_idle if state == IDLE else n.acquired_spec).append(m)
                n.remaining = vsub(n.remaining, cy.alloc[c.idx])
            if not any(n.remaining):
                return


def _reference_acquire_all(cy: CycleScratch, rows: list[NeedRow]) -> None:
    from bigfleet.decision.acquire import acquire_spread

    for n in rows:
        if not any(n.remaining) or n.parked:
            continue
        if n.same is not None:
            if not n.same_domain:
                continue
            dom = next((cl for v, cl in cy.domains(n, n.same.key) if v == n.same_domain), [])
            _reference_take(cy, n, dom, bucket_dollars(n.ib))
        elif n.spreads:
            acquire_spread(cy, n, cy.eligible(n), bucket_dollars(n.ib))
        else:
            _reference_take(cy, n, cy.eligible(n), bucket_dollars(n.ib))


def _reference_credit_all(cy: CycleScratch, rows: list[NeedRow], state: EngineState, gangs_first: bool = False) -> None:
    if gangs_first:
        rows = sorted(rows, key=lambda r: (-r.prio, r.same is None))
    for n in rows:
        if n.same is not None:
            credit_same(cy, n, state.same_domains.get(n.park_key))
        else:
            credit_plain(cy, n)


@st.composite
def equal_cost_fleet(draw: st.DrawFn) -> list[Machine]:
    """Many machines in few equal-cost classes (zones a/b/c of one type and price) with varied
    reclamation stamps: acquisitions pick across a group's classes by (reclamation, id)."""
    out = []
    for i in range(draw(st.integers(0, 40))):
        state = draw(st.sampled_from((S.IDLE, S.IDLE, S.SPECULATIVE, S.CONFIGURED, S.CREATING)))
        cluster = draw(st.sampled_from(CLUSTERS)) if state is S.CONFIGURED else ""
        out.append(machine(f"e{draw(st.integers(0, 99)):02d}-{i:02d}", state, cluster=cluster,
                           zone=draw(st.sampled_from("abc")), itype=draw(st.sampled_from(("t0", "t0", "t1"))),
                           res=g(1), price=1.0, rpd=draw(st.sampled_from((0.0, 0.0, 8.0, 512.0)))))
    return out


@SETTINGS
@given(st.one_of(equal_cost_fleet(), machines()), needs(), st.frozensets(st.sampled_from(CLUSTERS)))
def test_acquire_and_credit_fast_paths_decide_as_the_plain_loops(ms: list[Machine], ns: list[Need],
                                                                 ready: frozenset[str]) -> None:
    state = EngineState(first_rollup=ready)
    fast = decide(ns, Inventory(ms), NOW, state, EngineConfig())
    with mock.patch.object(cycle, "acquire_all", _reference_acquire_all), \
            mock.patch.object(cycle, "credit_all", _reference_credit_all):
        slow = decide(ns, Inventory(ms), NOW, state, EngineConfig())
    assert fast == slow


@given(st.lists(st.integers(min_value=-(2**80), max_value=2**80) | st.integers(min_value=-(2**64), max_value=2**64),
                min_size=2, max_size=40))
def test_ordered_int_sorts_as_the_ints_do_inside_and_beyond_int64(xs: list[int]) -> None:
    from bigfleet.decision.scratch import ordered_int

    enc = [ordered_int(x) for x in xs]
    assert sorted(xs) == [x for _, x in sorted(zip(enc, xs, strict=True))]
    pairs = list(zip(xs, reversed(xs), strict=True))  # concatenated fields keep field-by-field order
    assert sorted(pairs) == sorted(pairs, key=lambda p: ordered_int(p[0]) + ordered_int(p[1]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(-2, 9), st.integers(-1, 4)), min_size=1, max_size=4), st.integers(0, 12))
def test_memoised_units_equal_units_to_cover(pairs: list[tuple[int, int]], limit: int) -> None:
    """`CycleScratch.units` (memoised per vector pair), clamped as its callers clamp, answers as
    `units_to_cover` for every limit, asked again from the memo, allocatable zeros and negatives
    included."""
    from bigfleet.decision.vec import units_to_cover

    rem, unit = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    cy = CycleScratch(build_index([]), tuple(f"d{i}" for i in range(len(pairs))), {})
    for lim in (limit, limit + 3, 0):
        assert min(cy.units(rem, unit), lim) == units_to_cover(rem, unit, lim)
