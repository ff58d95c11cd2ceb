"""The pysyncobj password: flag handling, and what it protects on a real Raft port."""

from __future__ import annotations

import argparse
import pickle
import socket
import struct
import time
import zlib
from pathlib import Path

import pytest
from pysyncobj import SyncObj, SyncObjConf

from bigfleet.security.raft import (
    ENV_VAR,
    RaftPasswordError,
    add_raft_password_arguments,
    raft_password,
)
from bigfleet.testing import free_port, wait_until


def ns(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_raft_password_arguments(p)
    return p.parse_args(list(argv))


def test_password_sources(tmp_path: Path) -> None:
    assert raft_password(ns(), env={}) is None
    assert raft_password(ns(), env={ENV_VAR: "x" * 20}) == "x" * 20
    f = tmp_path / "pw"
    f.write_text("y" * 24 + "\n")
    assert raft_password(ns("--raft-password-file", str(f)), env={ENV_VAR: "x" * 20}) == "y" * 24
    with pytest.raises(RaftPasswordError, match="required"):
        raft_password(ns(), env={}, required=True)
    with pytest.raises(RaftPasswordError, match="shorter"):
        raft_password(ns(), env={ENV_VAR: "short"})
    with pytest.raises(RaftPasswordError, match="cannot read"):
        raft_password(ns("--raft-password-file", str(tmp_path / "missing")), env={})


class _Marker:
    """Unpickling this writes a file: the proof that a peer's bytes reached pickle.loads."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (Path.write_text, (Path(self.path), "pwned"))  # type: ignore[return-value]


def _send_pickle_frame(port: int, obj: object) -> None:
    data = zlib.compress(pickle.dumps(obj))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(struct.pack("i", len(data)) + data)
        s.settimeout(2)
        try:
            s.recv(1024)  # wait for the node to process (it answers or disconnects)
        except OSError:
            pass


def _node(port: int, password: str | None) -> SyncObj:
    conf = SyncObjConf(password=password, useFork=False, connectionRetryTime=0.5, dynamicMembershipChange=False)
    return SyncObj(f"127.0.0.1:{port}", [], conf=conf)


@pytest.mark.slow
@pytest.mark.parametrize("password", [None, "correct horse battery staple"])
def test_raft_port_unpickles_strangers_only_without_password(tmp_path: Path, password: str | None) -> None:
    port = free_port()
    node = _node(port, password)
    marker = tmp_path / "marker"
    try:
        wait_until(lambda: node._isReady(), timeout=30, what="single-node raft ready")
        for _ in range(3):  # the first frame of a connection is the node address or key exchange
            _send_pickle_frame(port, _Marker(str(marker)))
        if password is None:
            wait_until(marker.exists, timeout=30, what="unprotected port unpickled the payload")
        else:
            assert not marker.exists(), "a password-protected Raft port must not unpickle stranger bytes"
    finally:
        node.destroy()


@pytest.mark.slow
@pytest.mark.parametrize("same", [True, False])
def test_only_replicas_sharing_the_password_form_a_group(same: bool) -> None:
    a, b = free_port(), free_port()
    conf_a = SyncObjConf(password="p" * 20, useFork=False, connectionRetryTime=0.2)
    conf_b = SyncObjConf(password=("p" if same else "q") * 20, useFork=False, connectionRetryTime=0.2)
    n1 = SyncObj(f"127.0.0.1:{a}", [f"127.0.0.1:{b}"], conf=conf_a)
    n2 = SyncObj(f"127.0.0.1:{b}", [f"127.0.0.1:{a}"], conf=conf_b)
    try:
        if same:
            wait_until(lambda: n1._getLeader() is not None, timeout=30, what="leader with a shared password")
        else:
            # Absence can only be observed over a window: several election rounds (0.4-1.4 s each).
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                assert n1._getLeader() is None and n2._getLeader() is None
                time.sleep(0.1)
    finally:
        n1.destroy()
        n2.destroy()
