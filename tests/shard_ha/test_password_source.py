"""A Helm-installed shard replica group gets its Raft password from the variable the chart sets."""

from __future__ import annotations

import re
from pathlib import Path

from bigfleet.shard.ha.serve import PASSWORD_ENV, SHARED_PASSWORD_ENV, raft_password

HELPERS = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "bigfleet" / "templates" / "_helpers.tpl"


def test_precedence_flag_then_shard_variable_then_shared_variable() -> None:
    env = {PASSWORD_ENV: "shard-secret-0123456789", SHARED_PASSWORD_ENV: "shared-secret-0123456789"}
    assert raft_password("flag-secret-0123456789", env) == "flag-secret-0123456789"
    assert raft_password(None, env) == "shard-secret-0123456789"
    assert raft_password(None, {SHARED_PASSWORD_ENV: "shared-secret-0123456789"}) == "shared-secret-0123456789"
    assert raft_password(None, {}) == ""


def test_the_chart_sets_a_variable_the_shard_reads() -> None:
    names = set(re.findall(r"name:\s*(BIGFLEET_\w*RAFT_PASSWORD)", HELPERS.read_text()))
    assert names, "the chart no longer sets a Raft password variable"
    assert names <= {PASSWORD_ENV, SHARED_PASSWORD_ENV}


def test_a_replica_group_refuses_a_password_shorter_than_16_characters() -> None:
    from bigfleet.shard.config import ShardSettings
    from bigfleet.shard.ha.serve import raft_member

    group = {"shard_id": "s1", "provider": "127.0.0.1:1", "raft_bind": "127.0.0.1:7781", "raft_peers": "127.0.0.1:7782"}
    refused = raft_member(ShardSettings(**group, raft_password="x" * 15))
    assert isinstance(refused, str) and "shorter than 16" in refused
    assert raft_member(ShardSettings(**group, raft_password="x" * 16)) == ("127.0.0.1:7781", ["127.0.0.1:7782"], "x" * 16)
