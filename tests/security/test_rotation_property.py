"""Rotation logic under arbitrary file-update orders: the served pair is always a matching pair,
and it is the newest pair whose two files were both in place after a change."""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bigfleet.security import certs
from bigfleet.security.identity import shard
from bigfleet.security.tls import KeyPairReloader

CA = certs.generate_ca("rotation-ca")
PAIRS = [certs.issue_certificate(CA, shard(f"s{i}")) for i in range(3)]

step = st.one_of(
    st.tuples(st.just("cert"), st.integers(0, 2)),
    st.tuples(st.just("key"), st.integers(0, 2)),
    st.tuples(st.just("both"), st.integers(0, 2)),
    st.tuples(st.just("rm_key"), st.just(0)),
    st.tuples(st.just("garbage_cert"), st.just(0)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step, max_size=12))
def test_reloader_serves_only_matching_pairs(tmp_path_factory: object, steps: list[tuple[str, int]]) -> None:
    root = Path(tmp_path_factory.mktemp("rot"))  # type: ignore[attr-defined]
    crt, key = root / "tls.crt", root / "tls.key"
    certs.write_pair(PAIRS[0], crt, key)
    r = KeyPairReloader(crt, key, CA.cert_pem)
    tick = 1_000_000_000_000_000_000
    cert_now: bytes | None = PAIRS[0].cert_pem
    key_now: bytes | None = PAIRS[0].key_pem
    expected = (PAIRS[0].cert_pem, PAIRS[0].key_pem)
    for op, i in steps:
        tick += 1
        if op in ("cert", "both"):
            crt.write_bytes(PAIRS[i].cert_pem)
            os.utime(crt, ns=(tick, tick))
            cert_now = PAIRS[i].cert_pem
        if op in ("key", "both"):
            key.write_bytes(PAIRS[i].key_pem)
            os.utime(key, ns=(tick, tick))
            key_now = PAIRS[i].key_pem
        if op == "rm_key" and key.exists():
            key.unlink()
            key_now = None
        if op == "garbage_cert":
            crt.write_bytes(b"-----BEGIN CERTIFICATE-----\nnot really\n")
            os.utime(crt, ns=(tick, tick))
            cert_now = None
        r.poll()
        matching = [p for p in PAIRS if p.cert_pem == cert_now and p.key_pem == key_now]
        if matching:
            expected = (matching[0].cert_pem, matching[0].key_pem)
        assert r.pair == expected
        assert any(r.pair == (p.cert_pem, p.key_pem) for p in PAIRS)
