"""mTLS for the two tools that had none: ``bigfleet conformance`` certifies a provider that only speaks
mTLS (and pins shard certificates to the fenced shard id), and ``bigfleet all-in-one --tls auto`` runs
its whole local fleet with mTLS. Real processes throughout."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bigfleet.rpc import channel_options
from bigfleet.security import dial_sync
from bigfleet.security.certs import make_local_pki

from .daemons import client, start_provider, tls_flags


def _cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bigfleet.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _plaintext_health_fails(addr: str) -> bool:
    with grpc.insecure_channel(addr, options=channel_options()) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError:
            return True
    return False


@pytest.mark.slow
def test_conformance_certifies_an_mtls_provider(tmp_path: Path) -> None:
    make_local_pki(tmp_path, clusters=["c1"], shards=["conf"])
    provider, addr = start_provider(tmp_path)  # serves with the readonly certificate, the kit's role policy
    try:
        assert _plaintext_health_fails(addr)
        shard = tls_flags(tmp_path, "shard-conf")
        r = _cli("conformance", "--target", addr, "--quiet", *shard, "--tls-ca-key", str(tmp_path / "ca.key"))
        assert r.returncode == 0, r.stdout + r.stderr
        m = re.search(r"(\d+) passed, (\d+) failed, (\d+) skipped", r.stdout)
        assert m and int(m.group(1)) >= 25 and m.group(2) == "0", r.stdout
        # One certificate cannot speak for the many shard ids the fencing checks use: the kit refuses
        # those calls, which is why --tls-ca-key exists.
        r = _cli("conformance", "--target", addr, "--quiet", "--only", "C203", *shard)
        assert r.returncode == 1 and "0 passed, 1 failed" in r.stdout, r.stdout + r.stderr
        # Plaintext against an mTLS-only provider fails rather than passing vacuously.
        r = _cli("conformance", "--target", addr, "--quiet", "--only", "C101", timeout=120)
        assert r.returncode == 1, r.stdout + r.stderr
        assert provider.alive()
    finally:
        provider.stop()


def test_conformance_tls_flags_all_three_or_none(tmp_path: Path) -> None:
    r = _cli("conformance", "--target", "127.0.0.1:1", "--tls-cert", str(tmp_path / "x.crt"), timeout=60)
    assert r.returncode == 2 and "--tls-key" in r.stderr and "--tls-ca" in r.stderr
    r = _cli("conformance", "--target", "127.0.0.1:1", "--tls-ca-key", str(tmp_path / "ca.key"), timeout=60)
    assert r.returncode == 2 and "--tls-ca-key needs" in r.stderr
    r = _cli("all-in-one", "--tls-dir", str(tmp_path), timeout=60)
    assert r.returncode == 2 and "--tls auto" in r.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_all_in_one_runs_its_fleet_over_mtls(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bigfleet.cli.main", "all-in-one", "--clusters", "2", "--duration", "10",
         "--print-every", "5", "--tls", "auto", "--tls-dir", str(pki)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            up = re.search(r"fleet up: shard (\S+), coordinator (\S+), provider (\S+);", line)
            if up:
                break
        assert up, "".join(lines)
        assert "(mTLS)" in lines[-1]
        admin = client(pki, "admin")
        for addr in up.groups():
            assert _plaintext_health_fails(addr.rstrip(",")), f"{addr} answered plaintext"
            with dial_sync(addr.rstrip(","), admin) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert r.status == health_pb2.HealthCheckResponse.SERVING
        rest, _ = proc.communicate(timeout=180)
        out = "".join(lines) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, out
    assert "result: OK" in out and "coordinator: leader, 1 shard(s) registered" in out, out
    m = re.search(r"actions: Create (\d+), Configure (\d+)", out)
    assert m and int(m.group(2)) > 0, out  # the clusters' Sessions worked with their own certificates
    assert "operator reconnects 0" in out, out
    assert sorted(p.name for p in pki.glob("cluster-*.crt")) == ["cluster-cluster-00.crt", "cluster-cluster-01.crt"]
