"""The shared secret that keeps strangers off the pysyncobj Raft ports (decision 15).

pysyncobj's transport is zlib+pickle: without a password, anyone who can open a TCP connection
to a Raft port can make the replica unpickle arbitrary bytes (remote code execution) or send
it membership-changing utility commands. With ``password`` set, every frame is a Fernet token
(AES-128-CBC + HMAC-SHA256, key from PBKDF2 of the password) checked *before* unpickling, and
each connection mixes in random per-connection keys, so outsiders can neither read, inject nor
replay frames. It is not mTLS: one secret for the whole group, no per-peer identity, a fixed
salt, and an unauthenticated peer can still hold a connection open or make the reader buffer
a large length-prefixed frame (denial of service) — keep NetworkPolicy in front of it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

ENV_VAR = "BIGFLEET_RAFT_PASSWORD"
MIN_LENGTH = 16


class RaftPasswordError(ValueError):
    """Missing, unreadable or too short Raft password; a startup error."""


def add_raft_password_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--raft-password-file",
        default="",
        help=f"file holding the Raft group's shared secret (else ${ENV_VAR}); "
        f"at least {MIN_LENGTH} characters, the same on every replica",
    )


def raft_password(
    ns: argparse.Namespace,
    env: Mapping[str, str] | None = None,
    *,
    required: bool = False,
) -> str | None:
    """The password from ``--raft-password-file`` or the environment; ``None`` when unset.

    ``required`` turns "unset" into an error (multi-replica groups should pass True).
    """
    environ = os.environ if env is None else env
    path = getattr(ns, "raft_password_file", "") or ""
    if path:
        try:
            secret = Path(path).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise RaftPasswordError(f"cannot read --raft-password-file: {exc}") from None
        source = f"--raft-password-file {path}"
    else:
        secret = environ.get(ENV_VAR, "").strip()
        source = f"${ENV_VAR}"
    if not secret:
        if required:
            raise RaftPasswordError(f"a Raft password is required: set --raft-password-file or ${ENV_VAR}")
        return None
    if len(secret) < MIN_LENGTH:
        raise RaftPasswordError(f"Raft password from {source} is shorter than {MIN_LENGTH} characters")
    return secret


def raft_password_or_exit(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, *, required: bool = False
) -> str | None:
    try:
        return raft_password(ns, required=required)
    except RaftPasswordError as exc:
        parser.error(str(exc))
        raise
