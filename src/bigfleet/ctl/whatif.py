"""`bigfleetctl whatif -f request.yaml`: would these needs fit now, and at whose expense?

The file holds what users already write: CapacityRequest manifests (one or more YAML documents, or a
``kind: List``), folded into needs exactly as the operator folds them, or a ClusterCapacityNeeds-shaped
document (``clusterId`` + ``needs:`` in the proto's JSON form). The shard answers with ShardRead.WhatIf
(changes nothing); a follower's ``bigfleet-redirect`` is followed once to the leader.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from google.protobuf import json_format

from bigfleet.ctl.shardcmds import Emit, ShardCtl, UsageError, _kv, _reqs
from bigfleet.v1alpha1 import capacity_pb2
from bigfleet.v1alpha1 import shardread_pb2 as spb
from bigfleet.v1alpha1 import shardread_pb2_grpc as sgrpc


def add_args(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("-f", "--filename", required=True, help="YAML with CapacityRequests or a ClusterCapacityNeeds ('-': stdin)")
    sp.add_argument("--cluster", default="", help="the cluster the needs are for (finds its shard; default: the file's clusterId)")


@dataclass
class Candidates:
    cluster_id: str
    needs: list[capacity_pb2.CapacityNeed]
    #: need index -> the CapacityRequests (namespace/name) folded into it
    crs: dict[int, list[str]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def load(text: str, cluster: str) -> Candidates:
    """Parse the file into the candidate needs; raises UsageError saying what is wrong."""
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise UsageError(f"the file is not YAML: {exc}") from None
    objs: list[Mapping[str, object]] = []
    for d in docs:
        if not isinstance(d, Mapping):
            raise UsageError("every YAML document must be a mapping")
        items = d.get("items")
        if d.get("kind") == "List" and isinstance(items, list):
            objs.extend(i for i in items if isinstance(i, Mapping))
        else:
            objs.append(d)
    crs = [o for o in objs if o.get("kind") == "CapacityRequest"]
    rest = [o for o in objs if o.get("kind") != "CapacityRequest"]
    if crs and rest:
        raise UsageError("mix of CapacityRequests and other documents; use one shape per file")
    if crs:
        return _from_crs(crs, cluster)
    if len(rest) != 1:
        raise UsageError("expected CapacityRequest manifests or one ClusterCapacityNeeds document")
    msg = capacity_pb2.ClusterCapacityNeeds()
    try:
        json_format.ParseDict(dict(rest[0]), msg)
    except json_format.ParseError as exc:
        raise UsageError(f"not a ClusterCapacityNeeds: {exc}") from None
    cid = cluster or msg.cluster_id
    if not cid:
        raise UsageError("name the cluster with --cluster (or clusterId in the file)")
    if cluster and msg.cluster_id and msg.cluster_id != cluster:
        raise UsageError(f"--cluster {cluster!r} but the file says clusterId {msg.cluster_id!r}")
    return Candidates(cid, list(msg.needs))


def _from_crs(crs: Sequence[Mapping[str, object]], cluster: str) -> Candidates:
    from bigfleet.operator.rollup import build_rollup

    if not cluster:
        raise UsageError("CapacityRequests name no cluster: pass --cluster ID")
    roll = build_rollup(cluster, [dict(o) for o in crs], 0)
    out = Candidates(cluster, list(roll.message.needs), skipped=[f"{s.namespace}/{s.name}: {s.reason}" for s in roll.skipped])
    from bigfleet.operator.rollup import need_fingerprint

    index = {need_fingerprint(n): i for i, n in enumerate(out.needs)}
    for (ns, name), fp in sorted(roll.fingerprints.items()):
        if fp in index:
            out.crs.setdefault(index[fp], []).append(f"{ns}/{name}" if ns else name)
    return out


async def run(ctl: ShardCtl, args: argparse.Namespace, emit: Emit) -> int:
    try:
        text = sys.stdin.read() if args.filename == "-" else Path(args.filename).read_text()
    except OSError as exc:
        raise UsageError(f"cannot read {args.filename}: {exc.strerror}") from None
    cand = load(text, args.cluster)
    for s in cand.skipped:
        print(f"bigfleetctl whatif: skipped {s}", file=sys.stderr)
    if not cand.needs:
        raise UsageError("no needs to ask about")
    sid, addr = (await ctl.targets(cand.cluster_id))[0]
    req = spb.WhatIfRequest(cluster_id=cand.cluster_id, needs=cand.needs)
    resp, sid = await ask(ctl, sid, addr, req)
    data = to_data(sid, cand, resp)
    labels = spb.WhatIfOutcome.Name
    rows = [[
        a.index, ",".join(cand.crs.get(a.index, [])) or "-", cand.needs[a.index].priority,
        _kv(cand.needs[a.index].aggregate_resources), labels(a.outcome).removeprefix("WHAT_IF_OUTCOME_"),
        a.bound_count, a.idle_count, a.speculative_count, a.victims, a.message,
    ] for a in resp.answers]
    footer = (f"shard {sid}: " + ("all together: satisfiable" if resp.all_satisfiable else "all together: NOT satisfiable")
              + " (nothing was changed)")
    emit(args, data, ["NEED", "REQUESTS", "PRIORITY", "RESOURCES", "OUTCOME", "BOUND", "IDLE", "SPECULATIVE",
                      "VICTIMS", "DETAIL"], rows, footer)
    return 0


async def ask(ctl: ShardCtl, sid: str, addr: str, req: spb.WhatIfRequest) -> tuple[spb.WhatIfResponse, str]:
    """WhatIf on ``addr``; a follower's redirect is followed once (the shard is a Raft group)."""
    resp: spb.WhatIfResponse = await ctl.call(sid, addr,
                                            lambda ch: sgrpc.ShardReadStub(ch).WhatIf(req, timeout=ctl.timeout))
    return resp, sid


def to_data(sid: str, cand: Candidates, resp: spb.WhatIfResponse) -> dict[str, object]:
    return {
        "shard_id": sid, "cluster_id": cand.cluster_id, "cycle": resp.cycle, "all_satisfiable": resp.all_satisfiable,
        "answers": [{
            "index": a.index, "requests": cand.crs.get(a.index, []), "priority": cand.needs[a.index].priority,
            "resources": dict(cand.needs[a.index].aggregate_resources),
            "requirements": _reqs(cand.needs[a.index].requirements), "fingerprint": a.profile_fingerprint,
            "outcome": spb.WhatIfOutcome.Name(a.outcome).removeprefix("WHAT_IF_OUTCOME_").lower(),
            "satisfiable": a.outcome != spb.WHAT_IF_OUTCOME_UNSATISFIABLE,
            "bound": a.bound_count, "idle": a.idle_count, "speculative": a.speculative_count,
            "victims": a.victims, "victim_priorities": {str(v.priority): v.machines for v in a.victim_priorities},
            "unmet_reason": "" if not a.unmet_reason else spb.UnmetReason.Name(a.unmet_reason),
            "residual_deficit": dict(a.residual_deficit.resources),
            "displaced": [{"cluster_id": x.cluster_id, "fingerprint": x.profile_fingerprint, "priority": x.priority}
                          for x in a.displaced],
            "message": a.message,
        } for a in resp.answers],
    }
