"""A throwaway PKI shared by the security tests: generated once per session (EC keys are fast)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

import pytest

from bigfleet.security import certs
from bigfleet.security.identity import ADMIN, READONLY, Identity, cluster, shard


@dataclass
class Pki:
    root: Path
    ca: certs.KeyPair
    foreign_ca: certs.KeyPair

    def leaf(self, name: str, identity: Identity | None, **kw: object) -> tuple[Path, Path]:
        """Issue and write ``<name>.crt``/``.key`` signed by the main CA (or ``ca=`` override)."""
        ca = kw.pop("ca", self.ca)
        pair = certs.issue_certificate(ca, identity, **kw)  # type: ignore[arg-type]
        crt, key = self.root / f"{name}.crt", self.root / f"{name}.key"
        certs.write_pair(pair, crt, key)
        return crt, key

    @property
    def ca_file(self) -> Path:
        return self.root / "ca.crt"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    root = tmp_path_factory.mktemp("pki")
    ca = certs.generate_ca("test-ca")
    (root / "ca.crt").write_bytes(ca.cert_pem)
    p = Pki(root, ca, certs.generate_ca("foreign-ca"))
    for name, ident in {
        "admin": ADMIN,
        "readonly": READONLY,
        "cluster-a": cluster("cluster-a"),
        "cluster-b": cluster("cluster-b"),
        "shard-0": shard("shard-0"),
        "shard-1": shard("shard-1"),
    }.items():
        p.leaf(name, ident)
    p.leaf("no-identity", None)
    p.leaf("two-identities", ADMIN, extra_uris=["bigfleet://readonly"])
    p.leaf("foreign-scheme", ADMIN, extra_uris=["spiffe://example.org/ns/x"])
    p.leaf("foreign-ca-admin", ADMIN, ca=p.foreign_ca)
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=30)
    p.leaf("expired-admin", ADMIN, not_before=past, not_after=past + dt.timedelta(days=1))
    return p
