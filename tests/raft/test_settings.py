"""Raft settings pysyncobj would only assert on become a ValueError that says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigfleet.raft import RaftSettings, RaftSettingsError, sync_obj_conf, timing_problems


def _settings(**kw: object) -> RaftSettings:
    return RaftSettings(self_address="127.0.0.1:1", peers=[], data_dir=Path("/nonexistent"), password="p" * 16,
                        **kw)  # type: ignore[arg-type]


def test_defaults_and_the_edges_pysyncobj_accepts_pass() -> None:
    for s in (_settings(), _settings(election_min=0.16, election_max=1.0), _settings(compaction_min_entries=2)):
        assert timing_problems(s) == []
        sync_obj_conf(s, "j", "d").validate()  # pysyncobj agrees


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"election_max": 1.5}, "election_max must be at most 1 s, got 1.5"),
    ({"election_min": 0.6, "election_max": 0.6}, "election_max must be above election_min (0.6 s), got 0.6"),
    ({"election_min": 0.15}, "election_min must be above 3 heartbeat periods (0.15 s), got 0.15"),
    ({"heartbeat_period": 0.0}, "heartbeat_period must be above 0 s, got 0"),
    ({"leader_fallback": 0.05}, "leader_fallback must be above the heartbeat period (0.05 s), got 0.05"),
    ({"compaction_min_time": 0.0}, "compaction_min_time must be above 0 s, got 0"),
    ({"election_min": float("nan")}, "election_min must be a finite number, got nan"),
])
def test_what_pysyncobj_would_assert_on_is_named(kw: dict[str, float], fragment: str) -> None:
    s = _settings(**kw)
    assert any(fragment in p for p in timing_problems(s)), timing_problems(s)
    with pytest.raises(RaftSettingsError, match="invalid Raft settings") as ei:
        sync_obj_conf(s, "j", "d")
    assert isinstance(ei.value, ValueError) and ei.value.problems == timing_problems(s)


def test_names_map_fields_to_flags() -> None:
    assert timing_problems(_settings(election_max=2.0), {"election_max": "--raft-election-max"}) == [
        "--raft-election-max must be at most 1 s, got 2: pysyncobj drops a Raft connection silent for 1 s "
        "and requires election timeouts within that"]
