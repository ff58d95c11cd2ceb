"""Phase 2's victim score counts the drain grace a victim still has (spec decision 3).

score = interruption $ + reclamation $ + drain_grace_remaining × $/h. A CONFIGURED candidate has
not started draining, so the grace it still has is the whole grace its preempt Drain carries:
``drain_grace_seconds(preemptor, victim)``, where the victim's priority is the higher of its stamp
and the priority of the need crediting it this cycle. Every row below picks a different victim
than the penalties alone would (the grace term used to be 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from bigfleet.decision import Engine, EngineConfig, EngineState, victim_score
from bigfleet.machine import Inventory, Machine

from .fx import NOW, S, drains, machine, need, profile, run


@dataclass(frozen=True)
class Row:
    name: str
    victims: tuple[Machine, ...]
    preemptor: int
    units: int
    # (machine id, grace) of the preempt drains, in order
    want: tuple[tuple[str, int], ...]
    # what ordering by the penalties alone picks first (the old behaviour), when it differs
    penalties_alone: str | None
    extra_needs: tuple[tuple[str, int, int], ...] = ()  # (cluster, units, priority)


def _v(mid: str, prio: int, ipd: float, price: float, cluster: str = "b") -> Machine:
    return machine(mid, S.CONFIGURED, cluster=cluster, prio=prio, ipd=ipd, price=price)


ROWS = [
    Row("one class: the faster drain wins despite the higher penalty",
        # $36/h: 600 s cost $6, 10 s cost $0.10
        (_v("v-slow", 900_000, 1.0, 36.0), _v("v-fast", 0, 2.0, 36.0)),
        1_000_000, 1, (("v-fast", 10),), "v-slow"),
    Row("equal grace across classes: the expensive machine's grace costs more",
        # both 500 000 below the preemptor: 120 s; $360/h × 120 s = $12, $0/h costs nothing
        (_v("v-pricey", 500_000, 1.0, 360.0), _v("v-free", 500_000, 2.0, 0.0)),
        1_000_000, 1, (("v-free", 120),), "v-pricey"),
    Row("all of them in score order",
        # v-a 3 + 10 s × $36 = 3.1; v-b 1 + 600 s × $36 = 7; v-c 2 + 30 s × $36 = 2.3; v-d 5 + 0
        (_v("v-a", 0, 3.0, 36.0), _v("v-b", 950_000, 1.0, 36.0), _v("v-c", 400_000, 2.0, 36.0),
         _v("v-d", 990_000, 5.0, 0.0)),
        1_000_000, 4, (("v-c", 30), ("v-a", 10), ("v-d", 600), ("v-b", 600)), "v-b"),
    Row("the preemptor's priority sets the grace (500 001: v-low's gap is only 50 001)",
        (_v("v-high", 0, 1.5, 36.0), _v("v-low", 450_000, 1.0, 36.0)),
        500_001, 1, (("v-high", 30),), "v-low"),
    Row("same inventory, preemptor at 1M: v-low drains in 30 s and wins",
        (_v("v-high", 0, 1.5, 36.0), _v("v-low", 450_000, 1.0, 36.0)),
        1_000_000, 1, (("v-low", 30),), None),
    Row("a machine credited this cycle to a higher need drains with that need's (longer) grace",
        # h-held is stamped 0 but its cluster's need at 950 000 holds it: gap 50 000 → 600 s → 1 + 6
        (_v("h-held", 0, 1.0, 36.0, cluster="h"), _v("v-other", 400_000, 2.0, 36.0)),
        1_000_000, 1, (("v-other", 30),), "h-held", extra_needs=(("h", 1, 950_000),)),
    Row("... and is taken in its place in the order, between cheaper and dearer victims",
        # stamped order: h-held 1.1, v-other 2.3, v-third 8; true order: v-other 2.3, h-held 7, v-third 8
        (_v("h-held", 0, 1.0, 36.0, cluster="h"), _v("v-other", 400_000, 2.0, 36.0),
         _v("v-third", 0, 8.0, 0.0)),
        1_000_000, 3, (("v-other", 30), ("h-held", 600), ("v-third", 10)), "h-held",
        extra_needs=(("h", 1, 950_000),)),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_victim_order_counts_the_remaining_drain_grace(row: Row) -> None:
    needs = [need("t", row.units, profile(row.preemptor))]
    needs += [need(c, u, profile(p)) for c, u, p in row.extra_needs]
    d = run(needs, row.victims)
    got = [(a.machine_id, a.grace_period_seconds) for a in drains(d) if a.preemptor_priority == row.preemptor]
    assert tuple(got) == row.want
    assert row.want[0][0] != row.penalties_alone  # the grace term is what changed the pick


def test_the_score_uses_the_drain_grace_the_victim_gets() -> None:
    d = run([need("t", 1)], [_v("v", 950_000, 1.0, 36.0)])
    (dr,) = drains(d)
    assert dr.grace_period_seconds == 600
    assert victim_score(1.0, 0.0, dr.grace_period_seconds, 36.0) == pytest.approx(7.0)


def test_one_engine_orders_victims_per_preemptor_priority() -> None:
    """The per-class victim order is cached per priority tiering: a later cycle with a preemptor of
    another priority must not reuse the first preemptor's order."""
    inv = Inventory([_v("v-high", 0, 1.5, 36.0), _v("v-low", 450_000, 1.0, 36.0)])
    engine = Engine()
    picks = []
    for prio in (1_000_000, 500_001, 1_000_000):
        d = engine.decide([need("t", 1, profile(prio))], inv, NOW, EngineState(), EngineConfig())
        picks.append([a.machine_id for a in drains(d)])
    assert picks == [["v-low"], ["v-high"], ["v-low"]]


def test_lazy_victim_stream_equals_the_keyed_sort() -> None:
    """Phase 2 reads a class's candidates from a lazy stream (one (score, priority) bucket at a time,
    cached per tiering and replayed): the same machines, in the same order and with the same keys, as
    sorting by the per-machine key, however far it was read before; a cold build's streams (seeded
    with an `Inventory` group's distinct assignments, then scanning the records lazily) and an index
    maintained machine by machine agree."""
    import random
    from bisect import bisect_right
    from itertools import islice

    from bigfleet.decision.index import Index, add_machine, build_index, victim_stream
    from bigfleet.decision.preempt import _TIER_GRACE, _grace_bounds, _victim_key, _victim_key_of

    from .fx import machine

    rnd = random.Random(7)
    for _ in range(150):
        ms = [machine(f"m{i:04d}", S.CONFIGURED, cluster=rnd.choice("xyz"), price=rnd.choice((0.0, 1.5, 36.0)),
                      prio=rnd.choice((0, 100, 499_999, 899_999, 950_000, 1_000_000)),
                      ipd=rnd.choice((0.0, 1.0, 64.0, float("nan"), -3.0, float("inf"))),
                      rpd=rnd.choice((0.0, 8.0, 64.0)), fp=rnd.choice(("", "a", "b")))
              for i in rnd.sample(range(5000), rnd.choice((rnd.randint(0, 40), 900)))]  # (900: chunked scans)
        warm = Index()
        for m in ms:
            add_machine(warm, m)
        inv = Inventory(ms)  # (its groups seed each class's distinct assignments: streams scan lazily)
        seeded = build_index(inv.machines(), [(st, sh, g) for st in S for sh, g in inv.by_state(st).by_shape()])
        for ix in (build_index(ms), warm, seeded):
            for _ in range(3):
                bounds = _grace_bounds(rnd.choice((500_000, 1_000_000)))

                def key(m: Machine, bounds: tuple[int, ...] = bounds) -> tuple[float, int, str]:
                    # (the reference: each machine keyed alone, with its stamped tier's grace)
                    return _victim_key(m, _TIER_GRACE[bisect_right(bounds, m.assignment.priority)])

                for c in ix.classes:
                    want = sorted((m for m in ms if m.shape == c.shape and m.assignment.priority < bounds[-1]),
                                  key=key)
                    vs = victim_stream(ix, c.idx, bounds, _victim_key_of(bounds, c.shape.price_per_hour))
                    if vs is None:
                        assert want == []
                        continue
                    head = [it[3] for it in islice(vs, rnd.randint(0, 6))]
                    items = list(vs)
                    assert [it[3] for it in items] == want
                    assert head == want[: len(head)]
                    assert [it[:3] for it in items] == [key(m) for m in want]
