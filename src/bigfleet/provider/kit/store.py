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
    """A JSON snapshot file replaced atomically on every save."""

    durable = True

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.saves = 0

    def load(self) -> dict[str, Any] | None:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        if not raw.strip():
            return None
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError(f"{self.path}: state file is not a JSON object")
        return data

    def save(self, snapshot: dict[str, Any]) -> None:
        data = json.dumps(snapshot, separators=(",", ":")).encode()
        fd, tmp = tempfile.mkstemp(prefix=".store-", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self.saves += 1
        try:
            dfd = os.open(self.path.parent, os.O_RDONLY)
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
    that arrive while a save is running share the next one, so a burst of N
    mutations costs a handful of fsyncs, not N.
    """

    def __init__(self, store: Store, snapshot: Any, changes: Any) -> None:
        self.store = store
        self._snapshot = snapshot  # () -> dict, read on the event loop (consistent)
        self._changes = changes  # () -> int, the core's change counter
        self._saved = -1
        self._lock = asyncio.Lock()

    def mark_saved(self) -> None:
        self._saved = self._changes()

    async def flush(self) -> None:
        if not self.store.durable:
            return
        if self._saved >= self._changes():
            return
        async with self._lock:
            target = self._changes()
            if self._saved >= target:
                return
            snap = self._snapshot()
            if isinstance(self.store, FileStore):
                await asyncio.to_thread(self.store.save, snap)
            else:
                self.store.save(snap)
            self._saved = target
