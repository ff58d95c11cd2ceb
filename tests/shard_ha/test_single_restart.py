"""A shard's group of one (no --raft-bind) restarted on its data dir after a snapshot: the member is
on a new loopback port, and must lead again from its own journal and snapshot alone."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import structlog

from bigfleet.shard.config import ShardSettings
from bigfleet.shard.ha.node import DUMP_FILE, ShardRaft
from bigfleet.shard.ha.serve import raft_config, raft_member

from .group import PASSWORD


def _member(settings: ShardSettings, data_dir: Path) -> ShardRaft:
    member = raft_member(settings)
    assert not isinstance(member, str)
    bind, peers, password = member
    cfg = raft_config(settings, bind, peers, password, data_dir, structlog.get_logger())
    assert cfg is not None
    cfg.compaction_min_entries, cfg.compaction_min_time = 2, 0.2  # (snapshot at once, not after 60 s)
    return ShardRaft(cfg)


async def _leads(raft: ShardRaft, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if raft.is_leader():
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_group_of_one_leads_again_after_a_restart_from_its_snapshot(tmp_path: Path) -> None:
    settings = ShardSettings(shard_id="s1", provider="127.0.0.1:1", raft_password=PASSWORD)
    first = _member(settings, tmp_path)
    try:
        assert await _leads(first, 10)
        for i in range(20):
            assert await first.replace(f"c{i}", b"", 1, 0)
        deadline = time.monotonic() + 10
        while not (tmp_path / DUMP_FILE).exists() and time.monotonic() < deadline:
            await first.replace("c-more", b"", 1, 0)
            await asyncio.sleep(0.1)
        assert (tmp_path / DUMP_FILE).exists(), "no snapshot was written"
    finally:
        first.destroy()
    second = _member(settings, tmp_path)
    try:
        assert second.address != first.address  # (a fresh loopback port, as every start picks)
        assert await _leads(second, 15), f"the restarted member never led: {second.status()}"
        assert second.read(lambda s: {f"c{i}" for i in range(20)} <= set(s.rollups))
        assert second.members() == [second.address]
    finally:
        second.destroy()
