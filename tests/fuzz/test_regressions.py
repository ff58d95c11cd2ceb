"""Crashes found by fuzzing, as explicit repros.

Files under ``fuzz/regressions/<target>/`` are replayed through the target's harness. Bugs in
other areas that are still open are explicit non-strict xfails naming the owner; a fix turns
them into XPASS (then drop the xfail and the entry in known_open.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bigfleet.tools import fuzz

REGRESSIONS = Path(__file__).resolve().parents[2] / "fuzz" / "regressions"


def _cases() -> list[tuple[str, Path]]:
    if not REGRESSIONS.is_dir():
        return []
    return [(d.name, f) for d in sorted(REGRESSIONS.iterdir()) if d.is_dir() for f in sorted(d.glob("*.bin"))]


@pytest.mark.parametrize(("target", "path"), _cases(), ids=lambda v: v.name if isinstance(v, Path) else v)
def test_saved_crash_inputs_no_longer_crash(target: str, path: Path) -> None:
    harness, why = fuzz.load(target)
    if harness is None:
        pytest.skip(why)
    exc = fuzz.run_one(harness, path.read_bytes())
    assert exc is None, f"{type(exc).__name__}: {exc}"


def test_regression_corpus_is_not_empty() -> None:
    assert _cases(), "fuzz/regressions should hold at least the seed regressions"


@pytest.mark.parametrize("state", [None, "x", 1, [], True])
def test_coordinator_restore_with_junk_state_is_rejected_not_raised(state: object) -> None:
    st_mod = pytest.importorskip("bigfleet.coordinator.state")
    st = st_mod.FleetState()
    res = st.apply({"op": "restore", "state": state})
    assert isinstance(res, dict) and res.get("code") != st_mod.OK


@pytest.mark.parametrize(
    "spec",
    [
        {"priority": 1, "resources": {"bad name": "1"}},
        {"priority": 1, "resources": {"": "1"}},
        {"priority": 1, "resources": {"cpu": "1"}, "requirements": [{"key": "a b", "operator": "Exists"}]},
        {"priority": 1, "resources": {"cpu": "1"}, "requirements": [{"key": "zone", "operator": "In", "values": [""]}]},
        {"priority": 1, "resources": {"cpu": "1"}, "requirements": [{"key": "zone", "operator": "In", "values": ["a\x01"]}]},
    ],
)
def test_operator_roll_up_from_a_bad_cr_is_still_accepted_by_the_shard(spec: dict[str, object]) -> None:
    rollup = pytest.importorskip("bigfleet.operator.rollup")
    needs = pytest.importorskip("bigfleet.wire.needs")
    good = {"metadata": {"name": "good", "namespace": "d"}, "spec": {"priority": 5, "resources": {"cpu": "2"}}}
    bad = {"metadata": {"name": "bad", "namespace": "d"}, "spec": spec}
    r = rollup.build_rollup("cluster-a", [good, bad], 1)
    needs.rollup_from_proto(r.message, 1)  # the good CR's demand must survive the bad one


def test_colocated_cr_roll_up_is_accepted_by_the_shard() -> None:
    rollup = pytest.importorskip("bigfleet.operator.rollup")
    needs = pytest.importorskip("bigfleet.wire.needs")
    cr = {"metadata": {"name": "c", "namespace": "d"},
          "spec": {"priority": 1, "resources": {"cpu": "1"}, "coLocation": {"topologyKey": "rack"}}}
    r = rollup.build_rollup("cluster-a", [cr], 1)
    needs.rollup_from_proto(r.message, 1)


def test_cr_with_huge_max_skew_is_skipped_not_fatal() -> None:
    rollup = pytest.importorskip("bigfleet.operator.rollup")
    good = {"metadata": {"name": "good", "namespace": "d"}, "spec": {"priority": 5, "resources": {"cpu": "2"}}}
    bad = {"metadata": {"name": "bad", "namespace": "d"},
           "spec": {"priority": 1, "resources": {"cpu": "1"},
                    "topologySpread": [{"maxSkew": 2**31, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}]}}
    r = rollup.build_rollup("cluster-a", [good, bad], 1)
    assert r.crs_included == 1 and len(r.skipped) == 1
