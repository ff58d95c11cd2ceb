"""Snapshot archives, periodic export and offline restore.

An archive is a tar holding exactly ``meta.json`` then ``state`` (the
:meth:`FleetState.to_json` payload); an export directory holds the same two
files. Restore is offline: it wipes a stopped node's Raft files and leaves a
``restore.json`` that the node, started as a single voter, proposes as its
first write once it leads — so the restored state enters the replicated log
and every replica that joins later receives it.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import shutil
import tarfile
import time
from pathlib import Path
from typing import Any

from bigfleet.coordinator.raft import DUMP_FILE, JOURNAL_FILE, RESTORE_FILE

CHUNK = 1 << 20


class SnapshotError(Exception):
    pass


def build_archive(meta: dict[str, Any], state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("meta.json", _dump(meta)), ("state", _dump(state))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, indent=1).encode()


def write_archive_from_frames(path: Path, meta_json: bytes, data: bytes) -> dict[str, Any]:
    """Write what SnapshotSave streamed as a tar archive; returns the meta."""
    meta = json.loads(meta_json)
    json.loads(data)  # refuse to write a state we could not restore
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, blob in (("meta.json", meta_json), ("state", data)):
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            info.mtime = int(time.time())
            tar.addfile(info, io.BytesIO(blob))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, path)
    return dict(meta)


def read_archive(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, state) from a tar archive or an export directory."""
    try:
        if path.is_dir():
            meta = json.loads((path / "meta.json").read_bytes())
            state = json.loads((path / "state").read_bytes())
        else:
            with tarfile.open(path, mode="r") as tar:
                names = tar.getnames()
                if names[:2] != ["meta.json", "state"]:
                    raise SnapshotError(f"{path}: expected meta.json then state, found {names}")
                m, s = tar.extractfile("meta.json"), tar.extractfile("state")
                if m is None or s is None:
                    raise SnapshotError(f"{path}: unreadable members")
                meta, state = json.loads(m.read()), json.loads(s.read())
    except (OSError, tarfile.TarError, json.JSONDecodeError) as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc}") from exc
    if int(meta.get("Index", 0)) <= 0:
        raise SnapshotError(f"{path}: snapshot index 0 is not restorable")
    return meta, state


def export(dir_: Path, meta: dict[str, Any], state: dict[str, Any], now: float) -> Path:
    """Write ``<dir>/<YYYYMMDD-HHMMSS>-<id>/{meta.json,state}`` and repoint ``latest`` atomically."""
    dir_.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    target = dir_ / f"{stamp}-{meta['ID']}"
    tmp = dir_ / f".{target.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    (tmp / "meta.json").write_bytes(_dump(meta))
    (tmp / "state").write_bytes(_dump(state))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    link_tmp = dir_ / ".latest.tmp"
    if link_tmp.is_symlink() or link_tmp.exists():
        link_tmp.unlink()
    link_tmp.symlink_to(target.name)
    os.replace(link_tmp, dir_ / "latest")
    return target


def prepare_restore(archive: Path, data_dir: Path) -> dict[str, Any]:
    """Offline restore into ``data_dir`` (the node must be stopped)."""
    meta, state = read_archive(archive)
    data_dir.mkdir(parents=True, exist_ok=True)
    for entry in data_dir.iterdir():
        if entry.name.startswith((JOURNAL_FILE, DUMP_FILE)) or entry.name == RESTORE_FILE:
            entry.unlink()
    seed = {
        "state": state,
        "term_offset": int(meta.get("Term", 0)),
        "incarnation": secrets.token_hex(8),
        "source_index": int(meta.get("Index", 0)),
    }
    tmp = data_dir / (RESTORE_FILE + ".tmp")
    tmp.write_text(json.dumps(seed))
    os.replace(tmp, data_dir / RESTORE_FILE)
    return meta


def pending_restore(data_dir: Path) -> dict[str, Any] | None:
    p = data_dir / RESTORE_FILE
    if not p.exists():
        return None
    return dict(json.loads(p.read_text()))


def clear_restore(data_dir: Path) -> None:
    p = data_dir / RESTORE_FILE
    if p.exists():
        p.unlink()
