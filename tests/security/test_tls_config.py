"""Flag handling, file validation and the certificate CLI."""

from __future__ import annotations

import argparse
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from bigfleet.security import TLSConfig, TLSConfigError, add_tls_arguments, tls_from_args_or_exit
from bigfleet.security.certs import make_local_pki
from bigfleet.security.identity import ADMIN, cluster, identity_from_certificate, shard

from .conftest import Pki


def parse(*argv: str) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="daemon")
    add_tls_arguments(p)
    return p, p.parse_args(list(argv))


def test_no_flags_is_plaintext() -> None:
    _, ns = parse()
    assert TLSConfig.from_args(ns) is None


@pytest.mark.parametrize(
    "argv",
    [
        ("--tls-cert", "a.crt"),
        ("--tls-cert", "a.crt", "--tls-key", "a.key"),
        ("--tls-ca", "ca.crt"),
    ],
)
def test_partial_flags_are_a_startup_error(argv: tuple[str, ...]) -> None:
    p, ns = parse(*argv)
    with pytest.raises(TLSConfigError, match="together"):
        TLSConfig.from_args(ns)
    with pytest.raises(SystemExit) as ei:
        tls_from_args_or_exit(p, ns)
    assert ei.value.code == 2


def test_full_flags(pki: Pki) -> None:
    r = pki.root
    _, ns = parse("--tls-cert", str(r / "admin.crt"), "--tls-key", str(r / "admin.key"), "--tls-ca", str(pki.ca_file))
    cfg = TLSConfig.from_args(ns)
    assert cfg is not None and cfg.cert_file == r / "admin.crt"
    assert cfg.channel_credentials() is not None and cfg.server_credentials() is not None


def test_mismatched_key_missing_file_and_garbage(pki: Pki, tmp_path: Path) -> None:
    r = pki.root
    with pytest.raises(TLSConfigError, match="does not match"):
        TLSConfig.from_paths(r / "admin.crt", r / "readonly.key", pki.ca_file)
    with pytest.raises(TLSConfigError, match="cannot read"):
        TLSConfig.from_paths(tmp_path / "nope.crt", r / "admin.key", pki.ca_file)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a pem")
    with pytest.raises(TLSConfigError, match="not a PEM certificate"):
        TLSConfig.from_paths(junk, r / "admin.key", pki.ca_file)
    with pytest.raises(TLSConfigError, match="private key"):
        TLSConfig.from_paths(r / "admin.crt", junk, pki.ca_file)
    with pytest.raises(TLSConfigError, match="CA bundle"):
        TLSConfig.from_paths(r / "admin.crt", r / "admin.key", junk)


def test_make_local_pki_layout_and_permissions(tmp_path: Path) -> None:
    out = make_local_pki(tmp_path / "pki", clusters=["c1", "c2"], shards=["s0"])
    names = set(out)
    assert {"ca.crt", "ca.key", "admin.crt", "readonly.crt", "cluster-c1.crt", "cluster-c2.crt", "shard-s0.crt"} <= names
    assert identity_from_certificate(out["cluster-c2.crt"].read_bytes()) == cluster("c2")
    assert identity_from_certificate(out["shard-s0.crt"].read_bytes()) == shard("s0")
    assert identity_from_certificate(out["admin.crt"].read_bytes()) == ADMIN
    for name, path in out.items():
        if name.endswith(".key"):
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, name
    # Re-running keeps the CA, so older leaves stay valid.
    ca_before = out["ca.crt"].read_bytes()
    again = make_local_pki(tmp_path / "pki", clusters=["c3"], shards=[])
    assert again["ca.crt"].read_bytes() == ca_before
    TLSConfig.from_paths(again["cluster-c3.crt"], again["cluster-c3.key"], again["ca.crt"])


def test_certs_cli_runs_as_a_module(tmp_path: Path) -> None:
    out = tmp_path / "cli"
    res = subprocess.run(
        [sys.executable, "-m", "bigfleet.security.certs", "--out", str(out), "--cluster", "x,y", "--shard", "shard-3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert (out / "cluster-y.crt").exists() and (out / "shard-shard-3.key").exists()
    bad = subprocess.run(
        [sys.executable, "-m", "bigfleet.security.certs", "--out", str(out), "--cluster", "a/b"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "invalid cluster id" in bad.stderr


async def test_add_port_accepts_go_style_address_and_reports_bind_errors(pki: Pki) -> None:
    import grpc

    from bigfleet.security import add_port
    from bigfleet.security.tls import normalize_listen
    from bigfleet.testing import free_port

    assert normalize_listen(":7780") == "[::]:7780"
    assert normalize_listen("127.0.0.1:1") == "127.0.0.1:1"
    server = grpc.aio.server()
    port = free_port()
    try:
        assert add_port(server, f":{port}", None) == port
        with pytest.raises(OSError, match="cannot bind"):
            add_port(server, "256.1.1.1:1", TLSConfig.from_paths(pki.root / "admin.crt", pki.root / "admin.key", pki.ca_file))
    finally:
        await server.stop(None)
