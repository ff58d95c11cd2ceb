"""Pre-bound seeding: start the fake provider with some catalog machines already CONFIGURED.

Scale runs in steady state need a fleet that looks like one a shard has been serving for a while:
machines bound to clusters, carrying the ``cluster`` and ``shard_metadata`` the shard's Configure
wrote. The kit only seeds SPECULATIVE/IDLE records from a backend (a real cloud never reports
bindings), so the pre-bound fleet is handed to the kit as a restored state snapshot instead: the
same path a provider restart with a state file takes, which the shard already handles.

Seed file (JSON): ``{"version": 1, "bindings": [{"id": ..., "cluster": ..., "md": {...}}, ...]}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bigfleet.provider.kit.core import ProviderCore, check_configure_args
from bigfleet.provider.kit.model import HostRef, Instance, KitError, State

SEED_VERSION = 1


@dataclass(frozen=True)
class Binding:
    """One machine that starts CONFIGURED for `cluster` with this shard metadata."""

    machine_id: str
    cluster: str
    shard_metadata: dict[str, str]


def write_seed(path: str | Path, bindings: Iterable[Binding]) -> int:
    rows = [{"id": b.machine_id, "cluster": b.cluster, "md": b.shard_metadata} for b in bindings]
    Path(path).write_text(json.dumps({"version": SEED_VERSION, "bindings": rows}, separators=(",", ":")))
    return len(rows)


def read_seed(path: str | Path) -> list[Binding]:
    """Load a seed file; malformed content raises ValueError naming the offending entry."""
    data: Any = json.loads(Path(path).read_text())
    if not isinstance(data, Mapping) or data.get("version") != SEED_VERSION:
        raise ValueError(f"{path}: not a version-{SEED_VERSION} prebind seed file")
    out = []
    seen: set[str] = set()
    for i, row in enumerate(data.get("bindings") or []):
        if not isinstance(row, Mapping):
            raise ValueError(f"{path}: bindings[{i}] is not an object")
        mid, cluster, md = row.get("id"), row.get("cluster"), row.get("md") or {}
        if not isinstance(mid, str) or not mid or not isinstance(cluster, str) or not cluster:
            raise ValueError(f"{path}: bindings[{i}] needs a non-empty id and cluster")
        if not isinstance(md, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in md.items()):
            raise ValueError(f"{path}: bindings[{i}].md must map strings to strings")
        if mid in seen:
            raise ValueError(f"{path}: machine {mid!r} is bound twice")
        seen.add(mid)
        out.append(Binding(mid, cluster, dict(md)))
    return out


def host_for(instance: Instance, provider: str) -> HostRef:
    """The host a Create of this slot would have produced (committed hosts keep their own)."""
    if instance.host is not None and not instance.host.empty:
        return instance.host
    cloud = instance.labels.get("bigfleet.fake/cloud", "cloud")
    return HostRef(f"{provider}-{cloud}", f"i-prebound-{instance.id}")


def prebound_snapshot(catalog: list[Instance], bindings: Iterable[Binding], provider: str = "fake",
                      require_zone: bool = False) -> dict[str, object]:
    """A kit state snapshot: the catalog seeded as usual, then each binding's machine CONFIGURED.

    Every binding is validated like a Configure (cluster id, metadata limits); an unknown machine
    id or a bad binding raises ValueError, so a seed that does not fit the catalog fails at start.
    """
    core = ProviderCore()
    core.seed(catalog, require_zone)
    by_id = {inst.id: inst for inst in catalog}
    for b in bindings:
        rec = core.machines.get(b.machine_id)
        if rec is None:
            raise ValueError(f"prebind: machine {b.machine_id!r} is not in the catalog")
        try:
            check_configure_args(b.cluster, b.shard_metadata, 0)
        except KitError as exc:
            raise ValueError(f"prebind: machine {b.machine_id!r}: {exc}") from exc
        host = host_for(by_id[b.machine_id], provider)
        rec.state = State.CONFIGURED
        rec.cluster = b.cluster
        rec.shard_metadata = dict(b.shard_metadata)
        rec.host = HostRef(host.provider, host.ref)
        core.rev += 1
        rec.touch(core.rev)
    return core.snapshot()


class SeedStore:
    """A non-durable store whose first load is the pre-bound snapshot (later loads: nothing, like
    NullStore, so state still dies with the process)."""

    durable = False

    def __init__(self, snapshot: dict[str, object]) -> None:
        self._snap: dict[str, object] | None = snapshot

    def load(self) -> dict[str, Any] | None:
        snap, self._snap = self._snap, None
        return snap

    def save(self, snapshot: dict[str, Any]) -> None:
        pass
