"""bigfleetctl's shard verbs over mTLS: certificates from `bigfleetctl certs`, reads with the
readonly identity, pause refused to readonly and allowed to admin, no certificate refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from dashboard.fleet import ctl
from security.daemons import client, start_provider, start_shard, tls_flags

from bigfleet.security import dial_sync
from bigfleet.v1alpha1 import shardread_pb2, shardread_pb2_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    root = tmp_path_factory.mktemp("pki")
    made = ctl("certs", "--out", str(root), "--shard", "shard-0", "--cluster", "c1")
    assert made.returncode == 0, made.stderr
    assert (root / "admin.crt").exists() and (root / "readonly.crt").exists()
    for ext in ("crt", "key"):  # the security helpers name a shard's pair by its shard id
        (root / f"shard-0.{ext}").write_bytes((root / f"shard-shard-0.{ext}").read_bytes())
    prov, paddr = start_provider(root, "readonly", "--seed-count", "3")
    try:
        shard, saddr = start_shard(root, paddr, "shard-0")
        try:
            yield root, saddr
        finally:
            shard.stop()
    finally:
        prov.stop()


def actuation(root: Path, addr: str) -> shardread_pb2.ActuationStatus:
    with dial_sync(addr, client(root, "admin")) as ch:
        r: shardread_pb2.ActuationStatus = shardread_pb2_grpc.ShardAdminStub(ch).GetActuation(
            shardread_pb2.GetActuationRequest(), timeout=5)
        return r


def test_reads_with_readonly_and_pause_needs_admin(secure: tuple[Path, str]) -> None:
    root, addr = secure
    out = ctl(*tls_flags(root, "readonly"), "inventory", "--shard", addr, "-o", "json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0]["shard_id"] == addr
    refused = ctl(*tls_flags(root, "readonly"), "pause", "--shard", addr)
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr
    assert actuation(root, addr).paused is False
    ok = ctl(*tls_flags(root, "admin"), "pause", "--shard", addr)
    assert ok.returncode == 0, ok.stderr
    assert actuation(root, addr).paused is True
    assert ctl(*tls_flags(root, "admin"), "resume", "--shard", addr).returncode == 0
    assert actuation(root, addr).paused is False


def test_plaintext_client_is_refused(secure: tuple[Path, str]) -> None:
    _root, addr = secure
    out = ctl("inventory", "--shard", addr, "--timeout", "3")
    assert out.returncode == 1 and "unreachable" in out.stderr
