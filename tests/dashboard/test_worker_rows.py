"""With the engine in its worker process (the default) the shard keeps compact verdict rows
instead of Verdict objects; the dashboard's per-cluster verdict counts and action log must come
out the same as InspectNeeds says."""

from __future__ import annotations

import grpc
import pytest

from bigfleet.rpc import channel_options
from bigfleet.testing import wait_until
from bigfleet.v1alpha1 import shardread_pb2, shardread_pb2_grpc
from dashboard.fleet import Fleet, running_fleet

pytestmark = pytest.mark.slow


def verdicts(f: Fleet) -> dict[str, tuple[int, int]]:
    with grpc.insecure_channel(f.shard_addr, options=channel_options()) as ch:
        frames = list(shardread_pb2_grpc.ShardReadStub(ch).InspectNeeds(shardread_pb2.InspectNeedsRequest(), timeout=5))
    out: dict[str, tuple[int, int]] = {}
    for fr in frames[1:]:
        ok, bad = out.get(fr.need.cluster_id, (0, 0))
        out[fr.need.cluster_id] = (ok + fr.need.satisfied, bad + (not fr.need.satisfied))
    return out


def test_worker_mode_dashboard_matches_inspect_needs() -> None:
    with running_fleet("--engine-mode", "worker") as f:
        def agree() -> bool:
            d = f.api(f.shard_http)
            shown = {c["cluster_id"]: (c["satisfied"], c["unmet"]) for c in d["clusters"]}
            return shown == verdicts(f) == {"c1": (1, 0), "c2": (0, 1)} and bool(d["actions"])
        wait_until(agree, 30, what="dashboard verdict counts equal InspectNeeds in worker mode")
        kinds = {a["kind"] for a in f.api(f.shard_http)["actions"]}
        assert "Configure" in kinds
