"""Where the dashboard's JSON comes from: the shard's and coordinator's own gRPC servicers, called
in-process with a local context, so the page shows exactly what ``bigfleetctl`` and the read APIs
return (including "not leader" on a coordinator follower)."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from google.protobuf import json_format

from bigfleet.dashboard.model import SUMMED, ActionLog, History, Sample, ShortfallAges, shortfall_key
from bigfleet.machine.record import Machine
from bigfleet.machine.state import MachineState
from bigfleet.needs import Need
from bigfleet.v1alpha1 import coordinator_pb2, shardread_pb2

if TYPE_CHECKING:
    from bigfleet.shard.daemon import ShardDaemon
    from bigfleet.shard.readsvc import ShardAdminServicer, ShardReadServicer

BOUND_RECORD_STATES = frozenset({MachineState.CONFIGURING, MachineState.CONFIGURED, MachineState.DRAINING})
NEEDS_SHOWN = 200


class Source(Protocol):
    component: str

    async def snapshot(self, now: float) -> dict[str, Any]: ...


class LocalAbort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class LocalContext:
    """Just enough of grpc.aio.ServicerContext for the read handlers: abort raises LocalAbort."""

    def __init__(self) -> None:
        self.trailing: Sequence[tuple[str, str]] = ()

    def set_trailing_metadata(self, md: Sequence[tuple[str, str]]) -> None:
        self.trailing = md

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise LocalAbort(code, details)

    def peer(self) -> str:
        return "local:dashboard"

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        return ()


def iso(t: float) -> str:
    if not t:
        return ""
    return dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def short_state(name: str) -> str:
    return name.removeprefix("MACHINE_STATE_").lower()


def _reqs_text(reqs: Iterable[Any]) -> str:
    parts = []
    for r in reqs:
        parts.append(f"{r.key} {_op_name(r.operator)} {','.join(r.values)}".strip())
    return "; ".join(parts)


def _op_name(op: int) -> str:
    from bigfleet.v1alpha1 import capacity_pb2

    try:
        return capacity_pb2.NodeSelectorRequirement.Operator.Name(op).removeprefix("OPERATOR_")  # type: ignore[arg-type]
    except ValueError:
        return str(op)


def shortfall_rows(shortfalls: Iterable[coordinator_pb2.Shortfall], shard_id: str, ages: ShortfallAges,
                   now: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    keys: list[str] = []
    for sf in shortfalls:
        reqs = _reqs_text(sf.requirements)
        deficit = dict(sf.deficit.resources)
        rows.append({
            "shard_id": shard_id, "priority": sf.priority, "requirements": reqs, "deficit": deficit,
            "age_cycles": sf.age_cycles,
        })
        keys.append(f"{shard_id}|" + shortfall_key(sf.priority, reqs, deficit))
    first = ages.update(keys, now)
    for r, k in zip(rows, keys, strict=True):
        seen = first[k]
        r["first_seen"] = iso(seen)
        r["age_seconds"] = round(max(0.0, now - seen), 1)
    return rows


class ShardSource:
    """Dashboard data for one shard process."""

    component = "shard"

    def __init__(self, daemon: ShardDaemon, read: ShardReadServicer, admin: ShardAdminServicer, actions: ActionLog,
                 address: str = "") -> None:
        """``read``/``admin``: the servicers the replica serves for ``daemon`` (the page shows what
        they answer); ``actions``: the log the daemon feeds as one of its cycle observers."""
        self.d = daemon
        self.address = address
        self.read = read
        self.admin = admin
        self.history = History()
        self.ages = ShortfallAges()
        self.actions = actions

    def _satisfied(self, rec: Any) -> Callable[[str, str], bool | None]:
        """(cluster, fingerprint) → the last cycle's verdict, from the same record ShardRead serves."""
        if rec.decision is not None and rec.decision.verdicts:
            sat = {(v.cluster_id, v.fingerprint): v.satisfied for v in rec.decision.verdicts}
            return lambda c, f: sat.get((c, f))
        rows = rec.verdict_rows
        return lambda c, f: bool(rows[(c, f)][0]) if (c, f) in rows else None

    async def snapshot(self, now: float) -> dict[str, Any]:
        """Counts come from GetInventoryCounts, the needs table from InspectNeeds (capped), per-cluster
        sums from the same last-cycle record and machine view those read. Yields to the loop between
        the big passes so sessions keep being served on a large shard."""
        ctx: Any = LocalContext()
        counts = await self.read.GetInventoryCounts(shardread_pb2.InventoryCountsRequest(), ctx)
        await asyncio.sleep(0)
        frames = [f async for f in self.read.InspectNeeds(shardread_pb2.InspectNeedsRequest(limit=NEEDS_SHOWN), ctx)]
        header = frames[0].header
        views = [f.need for f in frames[1:]]
        sfs = await self.read.ListShortfalls(shardread_pb2.ListShortfallsRequest(), ctx)
        act = await self.admin.GetActuation(shardread_pb2.GetActuationRequest(), ctx)
        rec = self.d.last
        shard_id = self.d.config.shard_id
        by_state = {short_state(k): v for k, v in sorted(counts.by_state.items())}
        free = by_state.get("idle", 0) + by_state.get("speculative", 0)
        bound_total = sum(counts.bound_by_cluster.values())
        verdict = self._satisfied(rec)
        per_cluster, need_sum, unmet = _cluster_needs(rec.needs, verdict)
        await asyncio.sleep(0)
        bound_sum = _bound_sums(self.d.view.machines())
        for cid in counts.bound_by_cluster:
            per_cluster.setdefault(cid, {"cluster_id": cid, "needs": 0, "satisfied": 0, "unmet": 0})
        for c in per_cluster.values():
            c["shard_id"] = shard_id
            c["bound_machines"] = counts.bound_by_cluster.get(c["cluster_id"], 0)
            c["session"] = self.d.sessions.get(c["cluster_id"]) is not None
        shortfalls = shortfall_rows(sfs.shortfalls, shard_id, self.ages, now)
        self.history.add(Sample(now, counts.total, bound_total, free, len(rec.needs), unmet, len(shortfalls)))
        needs = [_need_row(v) for v in views]
        status = "paused" if act.paused else ("dry-run" if act.dry_run else "up")
        return {
            "component": "shard",
            "id": shard_id,
            "generated_at": iso(now),
            "error": "",
            "cycle": header.cycle,
            "computed_at": iso(header.computed_at_unix_nanos / 1e9),
            "paused": act.paused,
            "dry_run": act.dry_run,
            "reconciled": counts.reconciled,
            "shards": [{
                "shard_id": shard_id, "address": self.address, "status": status, "epoch": counts.shard_epoch,
                "machines": counts.total, "free": free, "clusters": len(per_cluster), "shortfalls": len(shortfalls),
                "last_heartbeat": "",
            }],
            "clusters": sorted(per_cluster.values(), key=lambda c: c["cluster_id"]),
            "inventory": {
                "total": counts.total, "in_flight": counts.in_flight, "free": free, "bound": bound_total,
                "by_state": by_state, "bound_by_cluster": dict(sorted(counts.bound_by_cluster.items())),
            },
            "capacity": [{"cluster_id": cid, "need": need_sum.get(cid, {}), "bound": bound_sum.get(cid, {})}
                         for cid in sorted(set(need_sum) | set(bound_sum))],
            "needs_total": header.total_needs,
            "needs": needs,
            "shortfalls": shortfalls,
            "actions": self.actions.to_json(),
            "history": self.history.to_json(),
        }


def _cluster_needs(needs: Iterable[Need], verdict: Callable[[str, str], bool | None]
                   ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, int]], int]:
    """Per cluster: need counts by verdict and the summed demand; and how many needs are unmet."""
    need_sum: dict[str, dict[str, int]] = {}
    per_cluster: dict[str, dict[str, Any]] = {}
    unmet = 0
    for n in needs:
        cid = n.cluster_id
        c = per_cluster.get(cid)
        if c is None:
            c = per_cluster[cid] = {"cluster_id": cid, "needs": 0, "satisfied": 0, "unmet": 0}
            need_sum[cid] = {}
        c["needs"] += 1
        ok = verdict(cid, n.fingerprint)
        if ok is False:
            c["unmet"] += 1
            unmet += 1
        elif ok:
            c["satisfied"] += 1
        acc = need_sum[cid]
        for k in SUMMED:
            q = n.aggregate_resources.get(k)
            if q:
                acc[k] = acc.get(k, 0) + q
    return per_cluster, need_sum, unmet


def _bound_sums(machines: Iterable[Machine]) -> dict[str, dict[str, int]]:
    """Per cluster: the allocatable of its bound (configuring, configured, draining) machines."""
    out: dict[str, dict[str, int]] = {}
    for m in machines:
        if m.cluster and m.state in BOUND_RECORD_STATES:
            acc = out.setdefault(m.cluster, {})
            res = m.shape.allocatable
            for k in SUMMED:
                q = res.get(k)
                if q:
                    acc[k] = acc.get(k, 0) + q
    return out


def _need_row(v: shardread_pb2.NeedView) -> dict[str, Any]:
    return {
        "cluster_id": v.cluster_id, "priority": v.need.priority, "group": v.need.group,
        "resources": dict(v.need.aggregate_resources), "satisfied": v.satisfied,
        "claimed": v.claimed_machine_count, "age_cycles_unmet": v.age_cycles_unmet,
        "unmet_reason": "" if v.satisfied else shardread_pb2.UnmetReason.Name(v.unmet_reason)
        .removeprefix("UNMET_REASON_").lower(),
        "fingerprint": v.profile_fingerprint,
    }


def message_json(msg: Any) -> dict[str, Any]:
    return json_format.MessageToDict(msg, preserving_proto_field_name=True)


class ReplicaSource:
    """Dashboard data for one shard replica: the leading replica's :class:`ShardSource`, or, on a
    follower, an empty page naming the leader (the same answer its gRPC API gives).

    ``current`` is read on every snapshot, so a replica that gains or loses leadership serves the
    right page without restarting its dashboard."""

    component = "shard"

    def __init__(self, shard_id: str, current: Callable[[], ShardSource | None],
                 leader_hint: Callable[[], str]) -> None:
        self.shard_id = shard_id
        self.current = current
        self.leader_hint = leader_hint
        self.history = History()

    async def snapshot(self, now: float) -> dict[str, Any]:
        src = self.current()
        if src is not None:
            return await src.snapshot(now)
        hint = self.leader_hint()
        return {
            "component": "shard", "id": self.shard_id, "generated_at": iso(now),
            "error": "this replica does not lead the shard" + (f"; leader at {hint}" if hint else ""),
            "leader": hint, "shards": [], "clusters": [], "inventory": {}, "capacity": [], "needs": [],
            "needs_total": 0, "shortfalls": [], "actions": [], "history": self.history.to_json(),
        }
