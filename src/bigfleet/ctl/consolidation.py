"""`bigfleetctl consolidation --plan`: what consolidation would replace and what it would save.

Each shard computes the plan on a copy of its state as if consolidation were on
(ShardRead.PlanConsolidation) and acts on nothing; the ENABLED column says whether it is on for the
cluster. Without --cluster or --shard/--shard-id every registered shard is asked.
"""

from __future__ import annotations

import argparse

from bigfleet.ctl.shardcmds import Emit, ShardCallFailed, ShardCtl, UsageError
from bigfleet.v1alpha1 import shardread_pb2 as spb
from bigfleet.v1alpha1 import shardread_pb2_grpc as sgrpc


def add_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--plan", action="store_true", required=True, help="show the moves (changes nothing)")
    sp.add_argument("--cluster", default="", help="only this cluster (finds its shard)")


def _m(p: spb.PlannedMachine) -> str:
    return f"{p.machine_id} ({p.instance_type or '?'} ${p.price_per_hour:g}/h)"


async def run(ctl: ShardCtl, args: argparse.Namespace, emit: Emit) -> int:
    if not args.plan:
        raise UsageError("consolidation needs --plan")
    req = spb.PlanConsolidationRequest(cluster_id=args.cluster)
    got: list[tuple[str, str, spb.PlanConsolidationResponse]] = []
    errors: list[str] = []
    for sid, addr in await ctl.targets(args.cluster):
        try:  # (a follower replica's redirect is followed to its leader)
            got.append((sid, addr, await ctl.call(sid, addr, lambda ch: sgrpc.ShardReadStub(ch).PlanConsolidation(
                req, timeout=ctl.timeout))))
        except ShardCallFailed as exc:
            errors.append(str(exc))
    if errors and not got:
        raise ShardCallFailed("; ".join(errors))
    data, rows, total = [], [], 0.0
    for sid, _addr, r in got:
        total += r.savings_per_hour
        for mv in r.moves:
            data.append({
                "shard_id": sid, "cycle": r.cycle, "cluster_id": mv.cluster_id, "need_fingerprint": mv.need_fingerprint,
                "kind": mv.kind, "enabled": mv.enabled, "savings_per_hour": mv.savings_per_hour,
                "replacement": {"machine_id": mv.replacement.machine_id, "instance_type": mv.replacement.instance_type,
                                "zone": mv.replacement.zone, "state": mv.replacement.state,
                                "price_per_hour": mv.replacement.price_per_hour} if mv.replacement.machine_id else None,
                "replaced": [{"machine_id": p.machine_id, "instance_type": p.instance_type, "zone": p.zone,
                              "price_per_hour": p.price_per_hour} for p in mv.replaced],
            })
            rows.append([sid, mv.cluster_id, mv.kind, "; ".join(_m(p) for p in mv.replaced),
                         _m(mv.replacement) if mv.replacement.machine_id else "-", f"{mv.savings_per_hour:.4g}",
                         "yes" if mv.enabled else "no"])
    footer = f"saving ${total:.4g}/hour once these moves complete (nothing was changed)"
    emit(args, data, ["SHARD", "CLUSTER", "KIND", "REPLACES", "WITH", "SAVES_$/H", "ENABLED"], rows, footer)
    return ctl._report(errors)
