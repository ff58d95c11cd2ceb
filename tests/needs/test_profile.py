"""Profile canonicalisation and the content-addressed fingerprint."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigfleet.needs import (
    Need,
    Operator,
    PenaltyBucket,
    Profile,
    Requirement,
    Resources,
    TopologySpread,
    WhenUnsatisfiable,
    merge_needs,
)

from .strategies import profiles

ZONE_AB = Requirement("zone", Operator.IN, ("a", "b"))
GPU = Requirement("gpu", Operator.EXISTS)
SPREAD = TopologySpread("zone", 1, WhenUnsatisfiable.DO_NOT_SCHEDULE)


def base(**over: object) -> Profile:
    kw: dict[str, object] = {
        "requirements": [ZONE_AB, GPU],
        "spread": [SPREAD],
        "priority": 1000,
        "interruption_bucket": PenaltyBucket.B8,
        "reclamation_bucket": PenaltyBucket.B64,
        "group": "",
    }
    kw.update(over)
    return Profile.build(**kw)  # type: ignore[arg-type]


# Fingerprints are persisted (shard_metadata on every configured machine), so the encoding is part of
# the contract: changing it orphans every running machine's attribution. This pins it.
GOLDEN = "29002a7496cc987e2574dd62d5e71c82"


def test_golden_fingerprint() -> None:
    assert base().fingerprint() == GOLDEN
    assert len(GOLDEN) == 32 and int(GOLDEN, 16) >= 0


def test_same_profile_built_two_ways() -> None:
    a = base()
    b = Profile(
        requirements=(GPU, Requirement("zone", Operator.IN, ("b", "a", "a")), GPU),
        spread=(SPREAD, SPREAD),
        priority=1000,
        interruption_bucket=PenaltyBucket(6),
        reclamation_bucket=9,  # type: ignore[arg-type]
    )
    assert a == b and hash(a) == hash(b)
    assert a.fingerprint() == b.fingerprint()
    assert a.requirements == (GPU, ZONE_AB)


@pytest.mark.parametrize(
    "change",
    [
        {"priority": 1001},
        {"priority": -1000},
        {"interruption_bucket": PenaltyBucket.B16},
        {"reclamation_bucket": PenaltyBucket.PINNED},
        {"group": "g1"},
        {"requirements": [ZONE_AB]},
        {"requirements": [Requirement("zone", Operator.IN, ("a",)), GPU]},
        {"requirements": [Requirement("zone", Operator.NOT_IN, ("a", "b")), GPU]},
        {"requirements": [Requirement("zone", Operator.SAME, ("a", "b")), GPU]},
        {"requirements": [Requirement("zone2", Operator.IN, ("a", "b")), GPU]},
        {"requirements": [ZONE_AB, GPU, Requirement("arch", Operator.DOES_NOT_EXIST)]},
        {"spread": []},
        {"spread": [TopologySpread("zone", 2)]},
        {"spread": [TopologySpread("zone", 1, WhenUnsatisfiable.SCHEDULE_ANYWAY)]},
        {"spread": [TopologySpread("host", 1)]},
    ],
)
def test_any_meaningful_change_changes_fingerprint(change: dict[str, object]) -> None:
    assert base(**change).fingerprint() != GOLDEN
    assert base(**change) != base()


def test_interruption_and_reclamation_are_not_interchangeable() -> None:
    a = base(interruption_bucket=PenaltyBucket.B8, reclamation_bucket=PenaltyBucket.B64)
    b = base(interruption_bucket=PenaltyBucket.B64, reclamation_bucket=PenaltyBucket.B8)
    assert a.fingerprint() != b.fingerprint()


def test_values_cannot_collide_through_separators() -> None:
    a = Profile.build([Requirement("k", Operator.IN, ("a,b",))])
    b = Profile.build([Requirement("k", Operator.IN, ("a", "b"))])
    c = Profile.build([Requirement("k:1", Operator.EXISTS)])
    assert len({a.fingerprint(), b.fingerprint(), c.fingerprint()}) == 3


_SCRIPT = """
from bigfleet.needs import *
p = Profile.build([Requirement('zone', Operator.IN, ('b','a')), Requirement('gpu', Operator.EXISTS)],
                  [TopologySpread('zone', 1)], 1000, PenaltyBucket.B8, PenaltyBucket.B64, '')
print(p.fingerprint())
"""


@pytest.mark.parametrize("seed", ["0", "12345"])
def test_stable_across_processes(seed: str) -> None:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == GOLDEN


def test_same_and_strict_spread() -> None:
    p = base()
    assert p.same is None
    assert p.strict_spread == SPREAD
    s = base(requirements=[Requirement("rack", Operator.SAME), ZONE_AB])
    assert s.same == Requirement("rack", Operator.SAME)
    assert s.strict_spread is None  # Same wins over spread
    lax = base(spread=[TopologySpread("zone", 1, WhenUnsatisfiable.SCHEDULE_ANYWAY)])
    assert lax.strict_spread is None


def test_matches_and_dollars() -> None:
    p = base()
    assert p.matches({"zone": "a", "gpu": "1"})
    assert not p.matches({"zone": "c", "gpu": "1"})
    assert p.interruption_penalty_dollars == 8.0
    assert p.reclamation_penalty_dollars == 64.0


def test_need_properties() -> None:
    p = base(group="g")
    n = Need("c1", p, Resources.parse({"cpu": "4"}), Resources.parse({"cpu": "1"}), 7)
    assert n.priority == 1000 and n.fingerprint == p.fingerprint() and n.requirements == p.requirements
    assert n.group == "g" and n.spread == p.spread and n.key == ("c1", p.fingerprint())
    assert n.interruption_bucket is PenaltyBucket.B8 and n.reclamation_bucket is PenaltyBucket.B64
    assert n.with_arrival(9).arrival_unix_nanos == 9 and n.with_arrival(9).same_demand(n)


def test_merge_needs() -> None:
    p, q = base(), base(priority=1)
    cpu = Resources.parse
    merged = merge_needs(
        [
            Need("c", p, cpu({"cpu": "1"}), cpu({"cpu": "1"}), 0),
            Need("c", q, cpu({"cpu": "5"}), cpu({"cpu": "5"}), 3),
            Need("c", p, cpu({"cpu": "2", "memory": "1Gi"}), cpu({"cpu": "2"}), 5),
            Need("c", p, cpu({"cpu": "3"}), cpu({"memory": "2Gi"}), 4),
        ]
    )
    assert [m.profile for m in merged] == [p, q]
    assert merged[0].aggregate_resources == cpu({"cpu": "6", "memory": "1Gi"})
    assert merged[0].min_unit == cpu({"cpu": "2", "memory": "2Gi"})
    assert merged[0].arrival_unix_nanos == 4  # earliest non-zero


@settings(deadline=None)
@given(profiles)
def test_fingerprint_is_a_function_of_the_canonical_content(p: Profile) -> None:
    shuffled = Profile(tuple(reversed(p.requirements)), tuple(reversed(p.spread)), p.priority,
                       p.interruption_bucket, p.reclamation_bucket, p.group)
    assert shuffled == p and shuffled.fingerprint() == p.fingerprint()


@settings(deadline=None)
@given(profiles, profiles)
def test_equal_iff_same_fingerprint(a: Profile, b: Profile) -> None:
    assert (a == b) == (a.fingerprint() == b.fingerprint())


@settings(deadline=None, max_examples=40)
@given(st.lists(profiles, min_size=2, max_size=6, unique=True))
def test_distinct_profiles_distinct_fingerprints(ps: list[Profile]) -> None:
    assert len({p.fingerprint() for p in ps}) == len(ps)
