"""`NeedsTable`: the shard's demand, one complete replacement per cluster at a time.

Pure and deterministic (the caller passes the time), so a Raft state machine can apply the same
``replace`` on every replica and end up with identical tables.
"""

from __future__ import annotations

from collections.abc import Iterable

from bigfleet.needs.profile import Need, merge_needs


def snapshot_sort_key(n: Need) -> tuple[int, int, str, str]:
    """Priority desc, arrival asc (older first), cluster asc; fingerprint last for a total order."""
    return (-n.profile.priority, n.arrival_unix_nanos, n.cluster_id, n.profile._fingerprint)


class NeedsTable:
    """``cluster_id → needs``; every ``replace`` swaps a cluster's whole contribution, never merges."""

    __slots__ = ("_by_cluster", "_cluster_gen", "_generation", "_snapshot")

    def __init__(self) -> None:
        self._by_cluster: dict[str, tuple[Need, ...]] = {}
        self._cluster_gen: dict[str, int] = {}
        self._generation = 0
        self._snapshot: tuple[Need, ...] | None = ()

    @property
    def generation(self) -> int:
        """Increments on every change to any cluster (never on a no-op replace)."""
        return self._generation

    def cluster_generation(self, cluster_id: str) -> int:
        """The table generation at which `cluster_id` last changed (0 if it never held demand).

        Survives removal, so "removed" and "re-added" are both visible to incremental consumers.
        """
        return self._cluster_gen.get(cluster_id, 0)

    def cluster_generations(self) -> dict[str, int]:
        return dict(self._cluster_gen)

    def replace(self, cluster_id: str, needs: Iterable[Need], now_unix_nanos: int) -> bool:
        """Make `needs` the cluster's complete demand; return whether anything changed.

        A need whose fingerprint the cluster already held keeps its original arrival time (its age);
        new rows get their own arrival time, or `now_unix_nanos` when they carry none. Rows repeating
        a fingerprint are merged. An empty list removes the cluster.
        """
        if not cluster_id:
            raise ValueError("empty cluster_id")
        incoming = list(needs)
        for n in incoming:
            if n.cluster_id != cluster_id:
                raise ValueError(f"need for cluster {n.cluster_id!r} in a roll-up for {cluster_id!r}")
        merged = merge_needs(incoming)
        old = self._by_cluster.get(cluster_id, ())
        old_by_fp = {n.profile._fingerprint: n for n in old}
        rows: list[Need] = []
        for n in merged:
            prev = old_by_fp.get(n.profile._fingerprint)
            arrival = prev.arrival_unix_nanos if prev is not None else (n.arrival_unix_nanos or now_unix_nanos)
            rows.append(n if n.arrival_unix_nanos == arrival else n.with_arrival(arrival))
        rows.sort(key=snapshot_sort_key)
        new = tuple(rows)
        if len(new) == len(old) and all(a.same_demand(b) and a.arrival_unix_nanos == b.arrival_unix_nanos
                                        for a, b in zip(new, old, strict=True)):
            return False
        if new:
            self._by_cluster[cluster_id] = new
        else:
            del self._by_cluster[cluster_id]
        self._bump(cluster_id)
        return True

    def remove(self, cluster_id: str) -> bool:
        """Drop the cluster's demand; return whether it held any."""
        if cluster_id not in self._by_cluster:
            return False
        del self._by_cluster[cluster_id]
        self._bump(cluster_id)
        return True

    def _bump(self, cluster_id: str) -> None:
        self._generation += 1
        self._cluster_gen[cluster_id] = self._generation
        self._snapshot = None

    def snapshot(self) -> tuple[Need, ...]:
        """Every need, priority desc, arrival asc, cluster asc. Cached until the next change; immutable."""
        snap = self._snapshot
        if snap is None:
            rows = [n for needs in self._by_cluster.values() for n in needs]
            rows.sort(key=snapshot_sort_key)
            snap = self._snapshot = tuple(rows)
        return snap

    def cluster(self, cluster_id: str) -> tuple[Need, ...]:
        """The cluster's needs in snapshot order (empty when it has none)."""
        return self._by_cluster.get(cluster_id, ())

    def clusters(self) -> list[str]:
        """Clusters holding demand, sorted."""
        return sorted(self._by_cluster)

    def get(self, cluster_id: str, fingerprint: str) -> Need | None:
        for n in self._by_cluster.get(cluster_id, ()):
            if n.profile._fingerprint == fingerprint:
                return n
        return None

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_cluster.values())

    def __contains__(self, cluster_id: object) -> bool:
        return cluster_id in self._by_cluster

    def __getstate__(self) -> dict[str, object]:
        return {"by_cluster": self._by_cluster, "cluster_gen": self._cluster_gen, "generation": self._generation}

    def __setstate__(self, state: dict[str, object]) -> None:
        self._by_cluster = dict(state["by_cluster"])  # type: ignore[call-overload]
        self._cluster_gen = dict(state["cluster_gen"])  # type: ignore[call-overload]
        self._generation = int(state["generation"])  # type: ignore[call-overload]
        self._snapshot = None
