"""InspectNeeds serves the same NeedView whether the cycle kept `Verdict` objects (thread and
inline modes) or the worker's compact rows (`engineproc.verdict_row`): ages come back from the
stored start cycle, quantities are formatted from the stored milli-units."""

from __future__ import annotations

import pytest

from bigfleet.decision.types import MatchingSupply, UnmetReason, Verdict
from bigfleet.needs import Resources
from bigfleet.shard.engineproc import verdict_row
from bigfleet.shard.readsvc import _fill_from_row, _fill_from_verdict
from bigfleet.v1alpha1 import shardread_pb2


def verdict(**kw: object) -> Verdict:
    base: dict[str, object] = dict(
        cluster_id="c1", fingerprint="fp", satisfied=False, deficit=Resources({"cpu": 1500, "memory": 2 << 30 << 10}),
        claimed_count=2, bootstrap_count=1, provision_count=3, same_domain="us-east-1a", same_satisfiable=True,
        parked=False, parked_age_cycles=0, unmet_since=36, unmet_reason=UnmetReason.NO_MATCHING_SUPPLY,
        matching_supply=MatchingSupply(idle=1, configured=7, speculative=0, capped=True),
    )
    base.update(kw)
    return Verdict(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("v", [
    verdict(),
    verdict(satisfied=True, deficit=Resources(), unmet_reason=UnmetReason.SATISFIED, unmet_since=-1),
    verdict(parked=True, parked_age_cycles=9, unmet_reason=UnmetReason.TOPOLOGY_UNSATISFIABLE),
    verdict(unmet_reason=UnmetReason.PREEMPTION_EXHAUSTED, victims_found=3,
            capacity_freed=Resources({"cpu": 250, "nvidia.com/gpu": 2000})),
    verdict(unmet_reason=UnmetReason.OTHER),  # not on the wire: served as 0
], ids=["unmet", "satisfied", "parked", "preemption", "other-reason"])
def test_row_and_verdict_give_the_same_need_view(v: Verdict) -> None:
    cycle = 40
    from_verdict, from_row = shardread_pb2.NeedView(), shardread_pb2.NeedView()
    _fill_from_verdict(from_verdict, v, cycle)
    _fill_from_row(from_row, verdict_row(v, cycle), cycle)
    assert from_row == from_verdict
    if not v.satisfied:
        assert from_row.residual_deficit.resources["cpu"] == "1500m"


def test_a_row_is_unchanged_while_only_the_age_grows() -> None:
    """What keeps the worker's reply small: an unmet need's row is the same every cycle, and read a
    cycle later it serves an age one higher."""
    v = verdict(unmet_since=36)
    assert v.age_at(40) == 4 and v.age_at(41) == 5
    assert verdict_row(v, 40) == verdict_row(v, 41)
    assert verdict_row(v, 40) != verdict_row(verdict(unmet_since=37), 40)
    later = shardread_pb2.NeedView()
    _fill_from_row(later, verdict_row(v, 40), 41)
    assert later.age_cycles_unmet == 5
    assert verdict(satisfied=True, unmet_since=-1).age_at(40) == 0
