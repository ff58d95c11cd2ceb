"""Only the leading replica reports to the coordinator, under the shard's identity and its own address."""

from __future__ import annotations

import asyncio
import tempfile
from functools import partial
from pathlib import Path

import pytest

from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.v1alpha1 import coordinator_pb2 as cpb

from .group import Group, Replica, until

pytestmark = pytest.mark.slow


async def _registered_at(coord: CoordGroup, r: Replica) -> bool:
    resp = await asyncio.to_thread(coord.call, 0, "ListShards", cpb.ListShardsRequest())
    return any(s.shard_id == "s1" and s.address == r.listen for s in resp.shards)  # type: ignore[attr-defined]


async def test_leader_heartbeats_and_the_new_leader_takes_over_the_registration() -> None:
    coord = CoordGroup(Path(tempfile.mkdtemp(prefix="bigfleet-ha-coord-")), 1, extra=("--log-level", "warning"))
    coord.start_all()
    g: Group | None = None
    ok = False
    try:
        await asyncio.to_thread(coord.leader, 30)
        g = await Group(("--seed-count", "0"), replica_args=(
            "--coordinator", coord.addr(0), "--heartbeat-interval", "0.3")).start()
        leader = await g.leader()
        await until(partial(_registered_at, coord, leader), 30, "the leader registered")
        assert leader.proc is not None
        leader.proc.kill()
        new = await g.leader(timeout=30, exclude=leader)
        await until(partial(_registered_at, coord, new), 30, "the new leader registered")
        ok = True
    finally:
        if g is not None:
            await g.close(dump=not ok)
        if not ok:
            print(coord.logs())
        coord.stop_all()
