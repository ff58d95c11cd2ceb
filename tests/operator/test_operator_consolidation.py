"""The operator's --consolidation on|off rides on every roll-up (ClusterCapacityNeeds.consolidation),
and a changed switch is a changed demand (the roll-up is resent)."""

from __future__ import annotations

from conftest import cr

from bigfleet.operator.cli import parser
from bigfleet.operator.rollup import build_rollup, demand_fingerprint


def test_switch_rides_on_the_rollup() -> None:
    crs = [cr("a", {"cpu": "1"})]
    on = build_rollup("c1", crs, 0, consolidation="on").message
    plain = build_rollup("c1", crs, 0).message
    assert on.consolidation == "on" and plain.consolidation == ""
    assert demand_fingerprint(on) != demand_fingerprint(plain)


def test_flag() -> None:
    p = parser()
    assert p.parse_args(["--cluster-id", "c1", "--shard-addr", "x:1", "--consolidation", "off"]).consolidation == "off"
    assert p.parse_args(["--cluster-id", "c1", "--shard-addr", "x:1"]).consolidation == ""
