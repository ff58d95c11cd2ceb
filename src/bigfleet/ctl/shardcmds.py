"""bigfleetctl's shard-side verbs (needs, inventory, shortfalls, pause, resume) over the shard's
ShardRead / ShardAdmin APIs.

Shards are found through the coordinator (``ListShards``; ``ListClusterBindings`` for a cluster's
shard) unless ``--shard HOST:PORT`` names one directly, which also works with no coordinator. Any
replica of a shard's group will do: a follower's redirect to its leader is followed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from bigfleet.v1alpha1 import coordinator_pb2 as cpb
from bigfleet.v1alpha1 import shardread_pb2 as spb
from bigfleet.v1alpha1 import shardread_pb2_grpc as sgrpc

Emit = Callable[[argparse.Namespace, Any, list[str], list[list[Any]], str], None]
T = TypeVar("T")
#: the trailing-metadata key a follower replica names its leader in
REDIRECT_KEY = "bigfleet-redirect"


class ShardCallFailed(Exception):
    """A shard could not be reached or refused the call (exit code 1)."""


class UsageError(Exception):
    """Bad flags or an unknown shard/cluster (exit code 2)."""


def add_target_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--shard", default="", metavar="HOST:PORT", help="talk to this shard directly (no coordinator)")
    sp.add_argument("--shard-id", default="", help="the registered shard with this id (looked up on the coordinator)")


def add_args(name: str, sp: argparse.ArgumentParser) -> None:
    add_target_args(sp)
    if name == "needs":
        sp.add_argument("--cluster", default="", help="the cluster whose needs to show (finds its shard)")
        sp.add_argument("--limit", type=int, default=0, help="at most this many needs (0 = all)")
        sp.add_argument("--unmet", action="store_true", help="only unsatisfied needs")
    elif name == "inventory":
        sp.add_argument("--cluster", default="", help="only machines of this cluster")
        sp.add_argument("--by-cluster", action="store_true", help="bound machines per cluster instead of per state")
    elif name == "shortfalls":
        sp.add_argument("--limit", type=int, default=0)
    elif name in ("pause", "resume"):
        sp.add_argument("--reason", default="", help="free text for the shard's log")
    elif name == "whatif":
        from bigfleet.ctl.whatif import add_args as whatif_args

        whatif_args(sp)
    elif name == "consolidation":
        from bigfleet.ctl.consolidation import add_args as consolidation_args

        consolidation_args(sp)


def _short(state: str) -> str:
    return state.removeprefix("MACHINE_STATE_").lower()


def _kv(m: Any) -> str:
    return ",".join(f"{k}={m[k]}" for k in sorted(m))


def _reqs(reqs: Any) -> str:
    from bigfleet.v1alpha1 import capacity_pb2

    out = []
    for r in reqs:
        op = capacity_pb2.NodeSelectorRequirement.Operator.Name(r.operator).removeprefix("OPERATOR_")
        out.append(f"{r.key} {op} {','.join(r.values)}".strip())
    return "; ".join(out) or "-"


class ShardCtl:
    def __init__(self, coordinator: Any, args: argparse.Namespace, tls: Any, emit: Emit) -> None:
        self.c = coordinator
        self.args = args
        self.tls = tls
        self.emit = emit
        self.timeout = float(args.timeout)

    # ------------------------------------------------------------- targets
    async def targets(self, cluster: str = "") -> list[tuple[str, str]]:
        """(shard id, address) pairs this command applies to."""
        a = self.args
        if a.shard:
            return [(a.shard_id or a.shard, a.shard)]
        shards = (await self.c.call("ListShards", cpb.ListShardsRequest())).shards
        if cluster and not a.shard_id:
            bindings = (await self.c.call("ListClusterBindings", cpb.ListClusterBindingsRequest())).bindings
            bound = [b.shard_id for b in bindings if b.cluster_id == cluster]
            if not bound:
                raise UsageError(f"cluster {cluster!r} is not bound to any shard (it binds when its operator first connects)")
            shards = [s for s in shards if s.shard_id == bound[0]]
            if not shards:
                raise ShardCallFailed(f"cluster {cluster!r} is bound to shard {bound[0]!r}, which is not registered")
        elif a.shard_id:
            shards = [s for s in shards if s.shard_id == a.shard_id]
            if not shards:
                raise UsageError(f"no shard {a.shard_id!r} is registered with the coordinator")
        if not shards:
            raise UsageError("no shards are registered with the coordinator")
        return [(s.shard_id, s.address) for s in shards]

    def _channel(self, address: str) -> grpc.aio.Channel:
        from bigfleet.security.tls import dial

        return dial(address, self.tls)

    async def call(self, shard_id: str, address: str, fn: Callable[[grpc.aio.Channel], Awaitable[T]]) -> T:
        """``fn`` on ``address``'s channel. A shard is a Raft group: a follower answers UNAVAILABLE with
        the leader in ``bigfleet-redirect``, which is followed once. INVALID_ARGUMENT is a usage error
        (exit 2), the rest a failed call (exit 1)."""
        for _ in range(2):
            async with self._channel(address) as ch:
                try:
                    return await fn(ch)
                except grpc.aio.AioRpcError as exc:
                    hint = dict(exc.trailing_metadata() or ()).get(REDIRECT_KEY, "")
                    if exc.code() == grpc.StatusCode.UNAVAILABLE and isinstance(hint, str) and hint and hint != address:
                        address = hint
                        continue
                    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        raise UsageError(f"shard {shard_id} refused the request: {exc.details()}") from None
                    if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise ShardCallFailed(
                            f"shard {shard_id} unreachable at {address}: {exc.details() or exc.code().name}") from None
                    raise ShardCallFailed(f"shard {shard_id} at {address}: {exc.code().name}: {exc.details()}") from None
        raise ShardCallFailed(f"shard {shard_id}: redirected more than once")

    async def _each(self, targets: list[tuple[str, str]], fn: Callable[[grpc.aio.Channel], Any]) -> tuple[list[tuple[str, str, Any]], list[str]]:
        """Call every target; a shard that fails is reported, the others are still shown."""
        ok, errors = [], []
        for sid, addr in targets:
            try:
                ok.append((sid, addr, await self.call(sid, addr, fn)))
            except ShardCallFailed as exc:
                errors.append(str(exc))
        if errors and not ok:
            raise ShardCallFailed("; ".join(errors))
        return ok, errors

    @staticmethod
    def _report(errors: list[str]) -> int:
        for e in errors:
            print(f"bigfleetctl: {e}", file=sys.stderr)
        return 1 if errors else 0

    # ------------------------------------------------------------- verbs
    async def needs(self) -> int:
        a = self.args
        if not a.cluster and not (a.shard or a.shard_id):
            raise UsageError("needs requires --cluster ID (or --shard/--shard-id for every cluster on one shard)")
        if a.limit < 0:
            raise UsageError("--limit must be >= 0")
        targets = await self.targets(a.cluster)
        if len(targets) > 1:
            raise UsageError("needs reads one shard; name it with --shard-id or --shard")
        sid, addr = targets[0]

        async def inspect(ch: grpc.aio.Channel) -> list[spb.InspectNeedsResponse]:
            call = sgrpc.ShardReadStub(ch).InspectNeeds(
                spb.InspectNeedsRequest(cluster_id=a.cluster, limit=a.limit), timeout=self.timeout)
            return [f async for f in call]

        frames = await self.call(sid, addr, inspect)
        header = frames[0].header if frames and frames[0].HasField("header") else spb.InspectNeedsHeader()
        views = [f.need for f in frames if f.HasField("need")]
        if a.unmet:
            views = [v for v in views if not v.satisfied]
        data = {
            "shard_id": sid, "cycle": header.cycle, "computed_at_unix_nanos": header.computed_at_unix_nanos,
            "total_needs": header.total_needs,
            "needs": [{
                "cluster_id": v.cluster_id, "priority": v.need.priority, "group": v.need.group,
                "resources": dict(v.need.aggregate_resources), "requirements": _reqs(v.need.requirements),
                "fingerprint": v.profile_fingerprint, "satisfied": v.satisfied,
                "claimed_machines": v.claimed_machine_count, "bootstrap_count": v.bootstrap_count,
                "provision_count": v.provision_count, "age_cycles_unmet": v.age_cycles_unmet,
                "unmet_reason": "" if v.satisfied else spb.UnmetReason.Name(v.unmet_reason),
                "residual_deficit": dict(v.residual_deficit.resources),
                "same_domain": v.same_domain, "parked": v.acquisition_parked, "bootstrap_error": v.bootstrap_error,
            } for v in views],
        }
        rows = [[
            v.cluster_id, v.need.priority, _kv(v.need.aggregate_resources), "yes" if v.satisfied else "no",
            v.claimed_machine_count,
            "-" if v.satisfied else spb.UnmetReason.Name(v.unmet_reason).removeprefix("UNMET_REASON_"),
            v.age_cycles_unmet, _kv(v.residual_deficit.resources) or "-",
        ] for v in views]
        footer = (f"shard {sid}, cycle {header.cycle}: {len(views)} shown of {header.total_needs} needs"
                  if header.cycle else f"shard {sid} has not run a cycle yet")
        self.emit(a, data, ["CLUSTER", "PRIORITY", "RESOURCES", "SATISFIED", "CLAIMED", "REASON", "UNMET_CYCLES", "DEFICIT"],
                  rows, footer)
        return 0

    async def inventory(self) -> int:
        a = self.args
        req = spb.InventoryCountsRequest(cluster_id=a.cluster)
        got, errors = await self._each(
            await self.targets(),
            lambda ch: sgrpc.ShardReadStub(ch).GetInventoryCounts(req, timeout=self.timeout))
        data = [{
            "shard_id": sid, "address": addr, "total": c.total, "in_flight": c.in_flight, "epoch": c.shard_epoch,
            "reconciled": c.reconciled, "by_state": {_short(k): v for k, v in sorted(c.by_state.items())},
            "bound_by_cluster": dict(sorted(c.bound_by_cluster.items())),
        } for sid, addr, c in got]
        if a.by_cluster:
            rows = [[d["shard_id"], cid, n] for d in data for cid, n in d["bound_by_cluster"].items()]
            self.emit(a, data, ["SHARD", "CLUSTER", "BOUND"], rows, "")
        else:
            states = sorted({s for d in data for s in d["by_state"]})
            rows = [[d["shard_id"], d["total"], *(d["by_state"].get(s, 0) for s in states), d["in_flight"],
                     "yes" if d["reconciled"] else "no"] for d in data]
            footer = f"total {sum(d['total'] for d in data)} machines on {len(data)} shard(s)" if len(data) > 1 else ""
            self.emit(a, data, ["SHARD", "TOTAL", *(s.upper() for s in states), "IN_FLIGHT", "RECONCILED"], rows, footer)
        return self._report(errors)

    async def shortfalls(self) -> int:
        a = self.args
        if a.limit < 0:
            raise UsageError("--limit must be >= 0")
        req = spb.ListShortfallsRequest(limit=a.limit)
        got, errors = await self._each(
            await self.targets(), lambda ch: sgrpc.ShardReadStub(ch).ListShortfalls(req, timeout=self.timeout))
        data, rows = [], []
        for sid, _addr, r in got:
            for sf in r.shortfalls:
                data.append({
                    "shard_id": sid, "cycle": r.cycle, "priority": sf.priority, "age_cycles": sf.age_cycles,
                    "deficit": dict(sf.deficit.resources), "requirements": _reqs(sf.requirements),
                    "interruption_penalty_bucket": int(sf.interruption_penalty_bucket),
                })
                rows.append([sid, sf.priority, _kv(sf.deficit.resources), sf.age_cycles, _reqs(sf.requirements)])
        self.emit(a, data, ["SHARD", "PRIORITY", "DEFICIT", "AGE_CYCLES", "REQUIREMENTS"], rows, "")
        return self._report(errors)

    async def set_paused(self, paused: bool) -> int:
        a = self.args
        if not (a.shard or a.shard_id):
            raise UsageError(f"{'pause' if paused else 'resume'} needs --shard-id ID or --shard HOST:PORT")
        sid, addr = (await self.targets())[0]

        async def flip(ch: grpc.aio.Channel) -> spb.ActuationStatus:
            stub = sgrpc.ShardAdminStub(ch)
            cur = await stub.GetActuation(spb.GetActuationRequest(), timeout=self.timeout)
            st: spb.ActuationStatus = await stub.SetActuation(
                spb.SetActuationRequest(paused=paused, dry_run=cur.dry_run, reason=a.reason), timeout=self.timeout)
            return st

        st = await self.call(sid, addr, flip)
        data = {"shard_id": sid, "paused": st.paused, "dry_run": st.dry_run, "cycle": st.cycle}
        if a.output == "table":
            word = "paused" if st.paused else "resumed"
            print(f"shard {sid}: {word} at cycle {st.cycle}" + (" (dry-run stays on)" if st.dry_run else ""))
        else:
            self.emit(a, data, [], [], "")
        return 0


async def run(verb: str, coordinator: Any, args: argparse.Namespace, tls: Any, emit: Emit) -> int:
    ctl = ShardCtl(coordinator, args, tls, emit)
    if verb == "needs":
        return await ctl.needs()
    if verb == "inventory":
        return await ctl.inventory()
    if verb == "shortfalls":
        return await ctl.shortfalls()
    if verb in ("pause", "resume"):
        return await ctl.set_paused(verb == "pause")
    if verb == "whatif":
        from bigfleet.ctl.whatif import run as whatif

        return await whatif(ctl, args, emit)
    if verb == "consolidation":
        from bigfleet.ctl.consolidation import run as consolidation

        return await consolidation(ctl, args, emit)
    raise UsageError(f"unknown shard verb {verb!r}")
