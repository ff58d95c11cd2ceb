"""Where a provider's state lives between restarts.

A store saves whole snapshots (the core's ``snapshot()`` dict). ``FileStore``
writes JSON to a temporary file in the same directory, fsyncs, renames it over
the target and fsyncs the directory, so a crash leaves either the old or the
new snapshot, never a torn one. ``MemStore`` keeps a private copy and lets a
test restart a server over the "same disk" in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Protocol


class Store(Protocol):
    durable: bool

    def load(self) -> dict[str, Any] | None: ...

    def save(self, snapshot: dict[str, Any]) -> None: ...


class NullStore:
    """No persistence: state dies with the process (the default without a state file)."""

    durable = False

    def load(self) -> dict[str, Any] | None:
        return None

    def save(self, snapshot: dict[str, Any]) -> None:
        pass


class MemStore:
    """Keeps a deep copy of the last save; a new server over the same MemStore reloads it."""

    durable = True

    def __init__(self) -> None:
        self._snap: dict[str, Any] | None = None
        self.saves = 0

    def load(self) -> dict[str, Any] | None:
        return copy.deepcopy(self._snap)

    def save(self, snapshot: dict[str, Any]) -> None:
        self._snap = copy.deepcopy(snapshot)
        self.saves += 1


class FileStore:
    """A JSON snapshot replaced atomically, plus an fsynced journal of deltas beside it.

    Rewriting the whole snapshot on every mutation costs O(fleet) per call; so
    each change is appended to ``<path>.journal`` as one JSON line (the changed
    records, upserts only) and the snapshot is rewritten only when the journal
    has grown past ``compact_bytes`` (and at start-up). Journal lines carry the
    core's change counter, so lines already folded into a snapshot are skipped
    on load, and a torn final line from a crash is ignored.
    """

    durable = True

    def __init__(self, path: str | os.PathLike[str], compact_bytes: int = 32 << 20) -> None:
        self.path = Path(path)
        self.journal_path = self.path.with_name(self.path.name + ".journal")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.compact_bytes = compact_bytes
        self.saves = 0
        self.appends = 0
        self._journal_size = 0
        self._snapshot_size = 0

    def load(self) -> dict[str, Any] | None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            raw = b""
        snap: dict[str, Any] | None = None
        if raw.strip():
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError(f"{self.path}: state file is not a JSON object")
            snap = data
        try:
            lines = self.journal_path.read_bytes().split(b"\n")
        except FileNotFoundError:
            lines = []
        deltas = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                deltas.append(json.loads(line))
            except json.JSONDecodeError:
                if i >= len(lines) - 2:  # a torn last write: the call it belonged to was never answered
                    break
                raise ValueError(f"{self.journal_path}: corrupt line {i + 1}") from None
        if deltas:
            snap = merge_deltas(snap, deltas)
        return snap

    def save(self, snapshot: dict[str, Any]) -> None:
        data = json.dumps(snapshot, separators=(",", ":")).encode()
        _atomic_write(self.path, data)
        self._snapshot_size = len(data)
        # The snapshot now holds everything the journal did.
        with open(self.journal_path, "wb") as f:
            f.flush()
            os.fsync(f.fileno())
        self._journal_size = 0
        self.saves += 1

    def append(self, delta: dict[str, Any]) -> None:
        line = json.dumps(delta, separators=(",", ":")).encode() + b"\n"
        with open(self.journal_path, "ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self._journal_size += len(line)
        self.appends += 1

    def wants_compaction(self) -> bool:
        return self._journal_size > max(self.compact_bytes, 2 * self._snapshot_size)


def merge_deltas(snap: dict[str, Any] | None, deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Fold journal deltas newer than the snapshot into it (upserts by key)."""
    base = snap or {"version": 1, "changes": 0, "rev": 0, "next_op": 1, "machines": [], "fences": [], "ops": []}
    seen = int(base.get("changes", 0))
    machines = {m["id"]: m for m in base.get("machines") or []}
    fences = {(f["shard_id"], f["machine_id"]): f for f in base.get("fences") or []}
    ops = {(o["machine_id"], o["kind"]): o for o in base.get("ops") or []}
    out = dict(base)
    for d in deltas:
        if int(d.get("changes", 0)) <= seen:
            continue
        for m in d.get("machines") or []:
            machines[m["id"]] = m
        for f in d.get("fences") or []:
            fences[(f["shard_id"], f["machine_id"])] = f
        for o in d.get("ops") or []:
            ops[(o["machine_id"], o["kind"])] = o
        out["changes"], out["rev"], out["next_op"] = d["changes"], d["rev"], d["next_op"]
    out["machines"], out["fences"], out["ops"] = list(machines.values()), list(fences.values()), list(ops.values())
    return out


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".store-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


class GroupCommitter:
    """Persist-before-answer with group commit.

    Every caller that changed state awaits ``flush()`` before it answers; calls
    that arrive while a write is running share the next one, so a burst of N
    mutations costs a handful of fsyncs, not N. Stores that can journal get a
    delta; the full snapshot is written at start-up and when the journal asks
    for compaction.
    """

    def __init__(self, store: Store, core: Any) -> None:
        self.store = store
        self.core = core  # ProviderCore: snapshot(), take_delta(), changes; read on the event loop
        self._saved = -1
        self._full_next = True
        self._lock = asyncio.Lock()

    async def flush(self) -> None:
        if not self.store.durable:
            return
        if self._saved >= self.core.changes:
            return
        async with self._lock:
            target = self.core.changes
            if self._saved >= target:
                return
            append = getattr(self.store, "append", None)
            threaded = isinstance(self.store, FileStore)
            try:
                if append is None or self._full_next or self.store.wants_compaction():  # type: ignore[attr-defined]
                    snap = self.core.snapshot()
                    if threaded:
                        await asyncio.to_thread(self.store.save, snap)
                    else:
                        self.store.save(snap)
                    self._full_next = False
                else:
                    delta = self.core.take_delta()
                    await asyncio.to_thread(append, delta)
            except BaseException:
                self._full_next = True  # the taken delta is lost: the next write must be a full snapshot
                raise
            self._saved = target
