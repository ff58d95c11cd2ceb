"""`bigfleetctl`: the admin CLI over the coordinator and ShardRead APIs.

Human tables by default, ``-o json|yaml`` for scripts. Every command talks to
the coordinator leader: ``--coordinator`` takes one or more replica addresses
and the client follows "not leader" hints, so pointing it at any replica works.
Exit codes: 0 ok, 1 the call failed (unreachable, refused), 2 usage (bad flags, unknown shard, cluster or
transfer — NOT_FOUND —, a file that cannot be read or written). Output cut short by a closed pipe
(``bigfleetctl clusters | head``) ends quietly with 141, as a process killed by SIGPIPE does.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml

from bigfleet.coordclient.client import CoordinatorClient, CoordinatorUnavailable
from bigfleet.ctl.shardcmds import ShardCallFailed, UsageError
from bigfleet.v1alpha1 import coordinator_pb2 as pb

COMMANDS = [
    ("shards", "list registered shards (status, last heartbeat, summary); `shards remove ID`"),
    ("clusters", "list cluster -> shard bindings (and handoffs in flight)"),
    ("lookup", "look up (and bind on first contact) a cluster's shard"),
    ("domains", "list, assign or unassign topology domains"),
    ("rebalance", "--plan | --apply cluster moves between shards"),
    ("transfers", "list cluster handoffs and inventory transfers; `transfers abort ID`"),
    ("snapshot", "save a coordinator snapshot archive"),
    ("raft", "join a replica to the coordinator's Raft group"),
    ("needs", "show a cluster's needs and the engine's verdicts (`needs --cluster ID`)"),
    ("inventory", "show shards' machines by state (or `--by-cluster`)"),
    ("shortfalls", "show unmet demand per shard"),
    ("pause", "pause a shard's actuation (`pause --shard-id ID`)"),
    ("resume", "resume a shard's actuation (`resume --shard-id ID`)"),
    ("whatif", "would these needs fit now, and how? (`whatif -f request.yaml --cluster ID`; changes nothing)"),
    ("consolidation", "what consolidation would replace and save (`consolidation --plan`; changes nothing)"),
    ("certs", "make a CA and per-role certificates for local use"),
]
SHARD_VERBS = {"needs", "inventory", "shortfalls", "pause", "resume", "whatif", "consolidation"}


class CtlError(Exception):
    """A usage error (exit code 2)."""


async def _call_named(c: CoordinatorClient, method: str, req: Any) -> Any:
    """``c.call`` for a request naming a shard or transfer: NOT_FOUND is a usage error (exit 2), as an
    unknown shard or cluster is for the shard verbs; every other refusal stays a failed call (exit 1)."""
    try:
        return await c.call(method, req)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            raise CtlError(f"NOT_FOUND: {exc.details()}") from None
        raise


def _ts(ns: int) -> str:
    if not ns:
        return "—"
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for r in cells:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _emit(args: argparse.Namespace, data: Any, headers: list[str], rows: list[list[Any]], footer: str = "") -> None:
    if args.output == "json":
        print(json.dumps(data, indent=2, sort_keys=True))
    elif args.output == "yaml":
        print(yaml.safe_dump(data, sort_keys=True).rstrip())
    else:
        print(_table(headers, rows) if rows else "(none)")
        if footer:
            print(footer)


# ----------------------------------------------------------------- commands
async def cmd_shards(c: CoordinatorClient, args: argparse.Namespace) -> int:
    if args.action == "remove":
        if not args.shard_id:
            raise CtlError("shards remove needs a shard id")
        await _call_named(c, "RemoveShard", pb.RemoveShardRequest(shard_id=args.shard_id))
        print(f"removed shard {args.shard_id} (its clusters re-bind on their next lookup)")
        return 0
    shards = (await c.call("ListShards", pb.ListShardsRequest())).shards
    reports = {r.shard_id: r for r in (await c.call("ListShardReports", pb.ListShardReportsRequest())).reports}
    bindings = (await c.call("ListClusterBindings", pb.ListClusterBindingsRequest())).bindings
    per_shard: dict[str, int] = {}
    for b in bindings:
        per_shard[b.shard_id] = per_shard.get(b.shard_id, 0) + 1
    now_ns = int(dt.datetime.now(tz=dt.UTC).timestamp() * 1e9)
    data, rows = [], []
    for s in shards:
        age = (now_ns - s.last_heartbeat_unix_ns) / 1e9 if s.last_heartbeat_unix_ns else None
        status = "down" if age is None or age > args.down_after else "up"
        r = reports.get(s.shard_id)
        total = r.summary.total_machines if r else 0
        free = r.summary.free_machines if r else 0
        shortfalls = len(r.shortfalls) if r else 0
        data.append(
            {
                "shard_id": s.shard_id,
                "address": s.address,
                "status": status,
                "registered": _ts(s.registered_at_unix_ns),
                "last_heartbeat": _ts(s.last_heartbeat_unix_ns),
                "clusters": per_shard.get(s.shard_id, 0),
                "machines": total,
                "free": free,
                "shortfalls": shortfalls,
                "provider_address": r.summary.provider_address if r else "",
            }
        )
        rows.append([s.shard_id, s.address, status, _ts(s.registered_at_unix_ns), _ts(s.last_heartbeat_unix_ns), per_shard.get(s.shard_id, 0), total, free, shortfalls])
    _emit(args, data, ["SHARD", "ADDRESS", "STATUS", "REGISTERED", "LAST_HEARTBEAT", "CLUSTERS", "MACHINES", "FREE", "SHORTFALLS"], rows)
    return 0


async def cmd_clusters(c: CoordinatorClient, args: argparse.Namespace) -> int:
    bindings = (await c.call("ListClusterBindings", pb.ListClusterBindingsRequest())).bindings
    data, rows = [], []
    for b in bindings:
        if args.shard and b.shard_id != args.shard:
            continue
        handoff = f"-> {b.handoff_to_shard_id} ({b.handoff_phase})" if b.handoff_to_shard_id else ""
        data.append(
            {
                "cluster_id": b.cluster_id,
                "shard_id": b.shard_id,
                "bound_at": _ts(b.bound_at_unix_ns),
                "epoch": b.binding_epoch,
                "handoff_to": b.handoff_to_shard_id,
                "handoff_phase": b.handoff_phase,
            }
        )
        rows.append([b.cluster_id, b.shard_id, b.binding_epoch, _ts(b.bound_at_unix_ns), handoff])
    _emit(args, data, ["CLUSTER", "SHARD", "EPOCH", "BOUND_AT", "HANDOFF"], rows)
    return 0


async def cmd_lookup(c: CoordinatorClient, args: argparse.Namespace) -> int:
    r = await c.call("LookupCluster", pb.LookupClusterRequest(cluster_id=args.cluster_id))
    data = {"cluster_id": r.cluster_id, "shard_id": r.shard_id, "shard_address": r.shard_address, "newly_bound": r.newly_bound, "epoch": r.binding_epoch}
    _emit(args, data, ["CLUSTER", "SHARD", "ADDRESS", "NEW"], [[r.cluster_id, r.shard_id, r.shard_address, "yes" if r.newly_bound else "no"]])
    return 0


async def cmd_domains(c: CoordinatorClient, args: argparse.Namespace) -> int:
    if args.action == "assign":
        if not (args.key and args.value and args.shard):
            raise CtlError("domains assign needs --key, --value and --shard")
        await _call_named(c, "AssignDomain", pb.AssignDomainRequest(topology_key=args.key, topology_value=args.value, shard_id=args.shard))
        print(f"assigned {args.key}={args.value} → {args.shard}")
        return 0
    if args.action == "unassign":
        if not (args.key and args.value):
            raise CtlError("domains unassign needs --key and --value")
        await c.call("UnassignDomain", pb.UnassignDomainRequest(topology_key=args.key, topology_value=args.value))
        print(f"unassigned {args.key}={args.value}")
        return 0
    rows_pb = (await c.call("ListDomainAssignments", pb.ListDomainAssignmentsRequest())).assignments
    data = [{"topology_key": a.topology_key, "topology_value": a.topology_value, "shard_id": a.shard_id} for a in rows_pb]
    _emit(args, data, ["TOPOLOGY_KEY", "TOPOLOGY_VALUE", "SHARD"], [[a.topology_key, a.topology_value, a.shard_id] for a in rows_pb])
    return 0


async def cmd_rebalance(c: CoordinatorClient, args: argparse.Namespace) -> int:
    if args.apply:
        req = pb.ApplyRebalanceRequest(load_factor=args.load_factor, max_moves=args.max_moves, expected_plan_id=args.plan_id)
        r = await c.call("ApplyRebalance", req)
        data = {"plan_id": r.plan_id, "started": [{"cluster_id": m.cluster_id, "from": m.from_shard_id, "to": m.to_shard_id} for m in r.started]}
        _emit(
            args,
            data,
            ["CLUSTER", "FROM", "TO"],
            [[m.cluster_id, m.from_shard_id, m.to_shard_id] for m in r.started],
            footer=f"started {len(r.started)} fenced handoffs (plan {r.plan_id}); follow them with `bigfleetctl transfers`",
        )
        return 0
    p = await c.call("PlanRebalance", pb.PlanRebalanceRequest(load_factor=args.load_factor, max_moves=args.max_moves))
    frac = len(p.moves) / p.total_clusters if p.total_clusters else 0.0
    data = {
        "plan_id": p.plan_id,
        "total_clusters": p.total_clusters,
        "live_shards": p.live_shards,
        "moves": [{"cluster_id": m.cluster_id, "from": m.from_shard_id, "to": m.to_shard_id} for m in p.moves],
        "load_before": dict(p.load_before),
        "load_after": dict(p.load_after),
        "stranded_clusters": list(p.stranded_clusters),
    }
    loads = ", ".join(f"{s}: {p.load_before[s]}→{p.load_after[s]}" for s in sorted(p.load_after))
    footer = (
        f"plan {p.plan_id}: {len(p.moves)} of {p.total_clusters} clusters move ({frac:.1%}) over {p.live_shards} live shards\n"
        f"load: {loads}"
        + (f"\nstranded on down shards (not moved): {len(p.stranded_clusters)}" if p.stranded_clusters else "")
        + f"\napply with: {_apply_hint(args, p.plan_id)}"
    )
    _emit(args, data, ["CLUSTER", "FROM", "TO"], [[m.cluster_id, m.from_shard_id, m.to_shard_id] for m in p.moves], footer)
    return 0


def _apply_hint(args: argparse.Namespace, plan_id: str) -> str:
    """The command that applies this plan: the plan id is a digest of the moves, which depend on
    --max-moves and --load-factor, so those set for planning (not at their defaults) are repeated."""
    opts = ""
    if args.max_moves:
        opts += f" --max-moves {args.max_moves}"
    if args.load_factor:
        opts += f" --load-factor {args.load_factor!r}"
    return f"bigfleetctl rebalance --apply{opts} --plan-id {plan_id}"


async def cmd_transfers(c: CoordinatorClient, args: argparse.Namespace) -> int:
    if args.action == "abort":
        if not args.transfer_id:
            raise CtlError("transfers abort needs a transfer id")
        t = (await _call_named(c, "AbortTransfer", pb.AbortTransferRequest(transfer_id=args.transfer_id))).transfer
        print(f"transfer {t.transfer_id}: {t.phase}" + (f" ({t.reason})" if t.reason else ""))
        return 0
    ts = (await c.call("ListTransfers", pb.ListTransfersRequest())).transfers
    data = [
        {
            "transfer_id": t.transfer_id,
            "kind": t.kind,
            "cluster_id": t.cluster_id,
            "from": t.from_shard_id,
            "to": t.to_shard_id,
            "phase": t.phase,
            "machines": list(t.machine_ids),
            "created": _ts(t.created_at_unix_ns),
            "reason": t.reason,
        }
        for t in ts
    ]
    rows = [[t.transfer_id, t.kind, t.cluster_id or "-", t.from_shard_id, t.to_shard_id, t.phase, len(t.machine_ids), t.reason] for t in ts]
    _emit(args, data, ["ID", "KIND", "CLUSTER", "FROM", "TO", "PHASE", "MACHINES", "REASON"], rows)
    return 0


async def cmd_snapshot(c: CoordinatorClient, args: argparse.Namespace) -> int:
    from bigfleet.coordinator.snapshot import write_archive_from_frames

    if args.action != "save" or not args.file:
        raise CtlError("usage: bigfleetctl snapshot save FILE")
    path = Path(args.file)
    # Check the destination before streaming the whole snapshot: not a directory, and the temporary
    # file the archive is written to (then renamed over FILE) can be created. It is removed on any
    # failure; after a successful rename it is gone already.
    if path.is_dir():
        raise CtlError(f"cannot write {path}: it is a directory")
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.open("wb").close()
    except OSError as exc:
        raise CtlError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        stream = await c.stream("SnapshotSave", pb.SnapshotSaveRequest())
        meta_json: bytes | None = None
        chunks: list[bytes] = []
        async for frame in stream:
            kind = frame.WhichOneof("payload")
            if meta_json is None:
                if kind != "meta_json":
                    raise CtlError("snapshot stream did not start with meta_json; refusing it")
                meta_json = frame.meta_json
            elif kind == "data":
                chunks.append(frame.data)
        if meta_json is None:
            raise CtlError("empty snapshot stream")
        try:
            meta = write_archive_from_frames(path, meta_json, b"".join(chunks))
        except OSError as exc:
            raise CtlError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    print(f"saved snapshot index={meta.get('Index')} term={meta.get('Term')} to {path}")
    return 0


async def cmd_raft(c: CoordinatorClient, args: argparse.Namespace) -> int:
    if args.action != "join" or not (args.node_id and args.raft_address):
        raise CtlError("usage: bigfleetctl raft join --node-id ID --raft-address HOST:PORT")
    await c.call("JoinRaftCluster", pb.JoinRaftClusterRequest(node_id=args.node_id, raft_address=args.raft_address), timeout=15.0)
    print(f"joined {args.node_id} at {args.raft_address}")
    return 0


HANDLERS = {
    "shards": cmd_shards,
    "clusters": cmd_clusters,
    "lookup": cmd_lookup,
    "domains": cmd_domains,
    "rebalance": cmd_rebalance,
    "transfers": cmd_transfers,
    "snapshot": cmd_snapshot,
    "raft": cmd_raft,
}


def seconds(text: str) -> float:
    """A finite number of seconds above 0 (argparse turns the ValueError into a usage error, exit 2)."""
    v = float(text)
    if not 0 < v < float("inf"):
        raise ValueError(text)
    return v


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument("--coordinator", default=argparse.SUPPRESS, help="coordinator address(es), comma-separated (default 127.0.0.1:7790)")
    common.add_argument("--timeout", type=seconds, default=argparse.SUPPRESS, help="seconds per RPC (default 10)")
    common.add_argument("-o", "--output", choices=["table", "json", "yaml"], default=argparse.SUPPRESS)
    p = argparse.ArgumentParser(prog="bigfleetctl", description=__doc__.splitlines()[0], parents=[common], allow_abbrev=False)
    try:
        from bigfleet.security.tls import add_tls_arguments

        add_tls_arguments(p)
    except ImportError:
        pass
    sub = p.add_subparsers(dest="command", metavar="<command>")
    for name, desc in COMMANDS:
        sp = sub.add_parser(name, help=desc, description=desc, parents=[common], allow_abbrev=False)
        if name == "shards":
            sp.add_argument("action", nargs="?", choices=["list", "remove"], default="list")
            sp.add_argument("shard_id", nargs="?", default="")
            sp.add_argument("--down-after", type=float, default=60.0, help="seconds of silence shown as down")
        elif name == "clusters":
            sp.add_argument("--shard", default="", help="only this shard's clusters")
        elif name == "lookup":
            sp.add_argument("cluster_id")
        elif name == "domains":
            sp.add_argument("action", nargs="?", choices=["list", "assign", "unassign"], default="list")
            sp.add_argument("--key", default="")
            sp.add_argument("--value", default="")
            sp.add_argument("--shard", default="")
        elif name == "rebalance":
            g = sp.add_mutually_exclusive_group(required=True)
            g.add_argument("--plan", action="store_true", help="show the moves (changes nothing)")
            g.add_argument("--apply", action="store_true", help="start fenced handoffs for the moves")
            sp.add_argument("--plan-id", default="", help="with --apply: refuse if the plan changed since it was reviewed")
            sp.add_argument("--max-moves", type=int, default=0)
            sp.add_argument("--load-factor", type=float, default=0.0, help="bounded-load factor c (default: the coordinator's, 1.25)")
        elif name == "transfers":
            sp.add_argument("action", nargs="?", choices=["list", "abort"], default="list")
            sp.add_argument("transfer_id", nargs="?", default="")
        elif name == "snapshot":
            sp.add_argument("action", choices=["save"])
            sp.add_argument("file", nargs="?", default="")
        elif name == "raft":
            sp.add_argument("action", choices=["join"])
            sp.add_argument("--node-id", default="")
            sp.add_argument("--raft-address", default="")
        elif name in SHARD_VERBS:
            from bigfleet.ctl.shardcmds import add_args

            add_args(name, sp)
        elif name == "certs":
            sp.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def _explain(exc: BaseException, addrs: list[str]) -> str:
    if isinstance(exc, CoordinatorUnavailable):
        text = str(exc)
        if "not leader" in text and "unavailable" not in text:
            return f"bigfleetctl: no coordinator at {','.join(addrs)} is the leader and none named one; is there quorum? ({text})"
        return f"bigfleetctl: coordinator unreachable at {','.join(addrs)}: {text}"
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"bigfleetctl: {exc.code().name}: {exc.details()}"
    return f"bigfleetctl: {exc}"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except BrokenPipeError:
        # The reader went away (`bigfleetctl clusters | head`): stop quietly. Point stdout at devnull
        # so the interpreter's final flush of what is still buffered does not fail again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141


def _main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not args_list or args_list[0] in ("-h", "--help", "help"):
        parser.print_help()
        return 0
    if args_list[0] == "certs":  # its own flags (--out ...) go straight to the security module
        try:
            from bigfleet.security.certs import main as certs_main
        except ImportError:
            print("bigfleetctl certs: not available in this build", file=sys.stderr)
            return 2
        return int(certs_main(args_list[1:]) or 0)
    args = parser.parse_args(args_list)
    if not args.command:
        parser.print_help()
        return 2
    args.coordinator = getattr(args, "coordinator", "127.0.0.1:7790")
    args.timeout = getattr(args, "timeout", 10.0)
    args.output = getattr(args, "output", "table")
    tls = None
    if getattr(args, "tls_cert", None) or getattr(args, "tls_ca", None):
        from bigfleet.security.tls import TLSConfig, TLSConfigError

        try:
            tls = TLSConfig.from_args(args)
        except TLSConfigError as exc:
            print(f"bigfleetctl: {exc}", file=sys.stderr)
            return 2
    addrs = [a.strip() for a in args.coordinator.split(",") if a.strip()]

    async def run() -> int:
        client = CoordinatorClient(addrs, timeout=args.timeout, tls=tls)
        try:
            if args.command in SHARD_VERBS:
                from bigfleet.ctl.shardcmds import run as run_shard_verb

                return await run_shard_verb(args.command, client, args, tls, _emit)
            return await HANDLERS[args.command](client, args)
        finally:
            await client.close()

    try:
        return asyncio.run(run())
    except CtlError as exc:
        print(f"bigfleetctl: {exc}", file=sys.stderr)
        return 2
    except UsageError as exc:
        print(f"bigfleetctl {args.command}: {exc}", file=sys.stderr)
        return 2
    except ShardCallFailed as exc:
        print(f"bigfleetctl {args.command}: {exc}", file=sys.stderr)
        return 1
    except (CoordinatorUnavailable, grpc.aio.AioRpcError) as exc:
        print(_explain(exc, addrs), file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
