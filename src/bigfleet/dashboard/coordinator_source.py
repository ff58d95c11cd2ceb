"""Dashboard data for a coordinator replica (its own module: only the coordinator imports it, so the
shard's dashboard never pulls in the coordinator's service)."""

from __future__ import annotations

from typing import Any

from bigfleet.dashboard.model import History, Sample, ShortfallAges, shortfall_key
from bigfleet.dashboard.sources import LocalAbort, LocalContext, iso
from bigfleet.v1alpha1 import coordinator_pb2


class CoordinatorSource:
    """Dashboard data for one coordinator replica. Only the leader has the fleet view; a follower
    answers with the leader's address (the same FAILED_PRECONDITION the gRPC API gives)."""

    component = "coordinator"

    def __init__(self, daemon: Any, down_after: float = 60.0) -> None:
        from bigfleet.coordinator.server import CoordinatorService

        self.d = daemon
        self.svc = CoordinatorService(daemon)
        self.down_after = down_after
        self.history = History()
        self.ages = ShortfallAges()

    async def snapshot(self, now: float) -> dict[str, Any]:
        ctx: Any = LocalContext()
        base: dict[str, Any] = {
            "component": "coordinator", "id": self.d.cfg.node_id, "generated_at": iso(now), "error": "",
            "shards": [], "clusters": [], "inventory": {}, "capacity": [], "needs": [], "needs_total": 0,
            "shortfalls": [], "actions": [], "history": self.history.to_json(),
        }
        try:
            shards = (await self.svc.ListShards(coordinator_pb2.ListShardsRequest(), ctx)).shards
            reports = (await self.svc.ListShardReports(coordinator_pb2.ListShardReportsRequest(), ctx)).reports
            bindings = (await self.svc.ListClusterBindings(coordinator_pb2.ListClusterBindingsRequest(), ctx)).bindings
            transfers = (await self.svc.ListTransfers(coordinator_pb2.ListTransfersRequest(), ctx)).transfers
        except LocalAbort as exc:
            base["error"] = exc.details
            base["leader"] = dict(ctx.trailing).get("bigfleet-leader", "")
            return base
        by_report = {r.shard_id: r for r in reports}
        per_shard: dict[str, int] = {}
        for b in bindings:
            per_shard[b.shard_id] = per_shard.get(b.shard_id, 0) + 1
        rows = []
        total = free = 0
        sf_rows: list[dict[str, Any]] = []
        by_type: dict[str, int] = {}
        all_sfs: list[tuple[str, coordinator_pb2.Shortfall]] = []
        for s in shards:
            age = now - s.last_heartbeat_unix_ns / 1e9 if s.last_heartbeat_unix_ns else None
            r = by_report.get(s.shard_id)
            m = r.summary.total_machines if r else 0
            f = r.summary.free_machines if r else 0
            total += m
            free += f
            if r:
                for k, v in r.summary.per_instance_type_counts.items():
                    by_type[k] = by_type.get(k, 0) + v
                all_sfs.extend((s.shard_id, sf) for sf in r.shortfalls)
            rows.append({
                "shard_id": s.shard_id, "address": s.address,
                "status": "down" if age is None or age > self.down_after else "up",
                "machines": m, "free": f, "clusters": per_shard.get(s.shard_id, 0),
                "shortfalls": len(r.shortfalls) if r else 0,
                "last_heartbeat": iso(s.last_heartbeat_unix_ns / 1e9), "epoch": 0,
            })
        first = self.ages.update(
            [f"{sid}|" + shortfall_key(sf.priority, "", dict(sf.deficit.resources)) for sid, sf in all_sfs], now)
        for sid, sf in all_sfs:
            seen = first[f"{sid}|" + shortfall_key(sf.priority, "", dict(sf.deficit.resources))]
            sf_rows.append({
                "shard_id": sid, "priority": sf.priority, "requirements": "", "deficit": dict(sf.deficit.resources),
                "age_cycles": sf.age_cycles, "first_seen": iso(seen), "age_seconds": round(max(0.0, now - seen), 1),
            })
        self.history.add(Sample(now, total, total - free, free, len(bindings), 0, len(sf_rows)))
        base.update({
            "shards": rows,
            "clusters": [{
                "cluster_id": b.cluster_id, "shard_id": b.shard_id, "epoch": b.binding_epoch,
                "bound_at": iso(b.bound_at_unix_ns / 1e9),
                "handoff": f"{b.handoff_to_shard_id} ({b.handoff_phase})" if b.handoff_to_shard_id else "",
            } for b in bindings],
            "inventory": {"total": total, "free": free, "bound": total - free, "by_instance_type": dict(sorted(by_type.items()))},
            "shortfalls": sf_rows,
            "actions": [{
                "t": t.created_at_unix_ns / 1e9, "cycle": 0, "kind": f"{t.kind} transfer", "machine_id": ",".join(t.machine_ids[:3])
                + ("…" if len(t.machine_ids) > 3 else ""), "cluster_id": t.cluster_id,
                "detail": f"{t.from_shard_id} → {t.to_shard_id}: {t.phase}" + (f" ({t.reason})" if t.reason else ""),
            } for t in sorted(transfers, key=lambda t: -t.created_at_unix_ns)[:100]],
            "history": self.history.to_json(),
        })
        return base
