"""The shard's restart epoch, persisted in ``<data-dir>/epoch``.

Every start bumps the epoch so that provider calls still in flight from a
previous incarnation (a zombie) carry an older fencing token and are refused.
A corrupt file is fatal: guessing would risk reusing an epoch.
"""

from __future__ import annotations

import os
from pathlib import Path


class EpochError(RuntimeError):
    pass


def bump_epoch(data_dir: str | os.PathLike[str]) -> int:
    """Read the stored epoch (missing = 0), add one, persist atomically, return the new value."""
    d = Path(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "epoch"
    current = 0
    if path.exists():
        text = path.read_text().strip()
        if not text.isdigit():
            raise EpochError(f"corrupt epoch file {path}: {text[:40]!r}")
        current = int(text)
    new = current + 1
    tmp = d / "epoch.tmp"
    with open(tmp, "w") as f:
        f.write(f"{new}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return new
