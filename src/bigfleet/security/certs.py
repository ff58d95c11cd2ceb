"""A local certificate authority and per-role leaf certificates for development and tests.

Production clusters should use cert-manager or an existing PKI; this module exists so that
`bigfleetctl certs`, the test-suite and the all-in-one mode can run the whole fleet under mTLS
without any external tooling. Keys are ECDSA P-256 (fast to generate, fine for TLS 1.3).

Every leaf carries exactly one ``bigfleet://`` URI SAN (the identity), the DNS/IP names the
process is dialled by, and both the ServerAuth and ClientAuth extended key usages, because one
certificate per process covers both the edges it serves and the edges it dials.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bigfleet.security.identity import Identity, Role

DEFAULT_HOSTS: tuple[str, ...] = ("localhost", "127.0.0.1", "::1")
_DEFAULT_VALIDITY = dt.timedelta(days=365)
_BACKDATE = dt.timedelta(minutes=5)  # tolerate small clock skew between hosts


@dataclass(frozen=True)
class KeyPair:
    """A PEM certificate (chain) and its PEM private key."""

    cert_pem: bytes
    key_pem: bytes


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def generate_ca(
    common_name: str = "bigfleet-local-ca",
    *,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> KeyPair:
    """A self-signed CA allowed to sign leaf certificates only (path length 0)."""
    start = not_before or (_utcnow() - _BACKDATE)
    end = not_after or (start + dt.timedelta(days=3650))
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _general_names(uris: Iterable[str], hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def issue_certificate(
    ca: KeyPair,
    identity: Identity | None,
    *,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    extra_uris: Sequence[str] = (),
    common_name: str | None = None,
    not_before: dt.datetime | None = None,
    not_after: dt.datetime | None = None,
) -> KeyPair:
    """A leaf signed by ``ca`` whose identity is ``identity`` (``None`` = no bigfleet SAN).

    ``extra_uris`` lets tests build deliberately malformed certificates (two bigfleet SANs,
    a foreign scheme, ...); production callers leave it empty.
    """
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("CA key must be an EC key")
    start = not_before or (_utcnow() - _BACKDATE)
    end = not_after or (start + _DEFAULT_VALIDITY)
    key = _new_key()
    uris = ([identity.uri] if identity is not None else []) + list(extra_uris)
    cn = common_name or (identity.uri if identity is not None else "bigfleet-leaf")
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn[:64])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    names = _general_names(uris, hosts)
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return KeyPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def identity_file_stem(identity: Identity) -> str:
    """File name stem for an identity: ``admin``, ``readonly``, ``cluster-<id>``, ``shard-<id>``."""
    return identity.role.value if not identity.id else f"{identity.role.value}-{identity.id}"


def write_pair(pair: KeyPair, cert_path: Path, key_path: Path) -> None:
    """Write a pair so that the key is never world-readable, not even for an instant."""
    cert_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pair.key_pem)
    os.chmod(key_path, 0o600)
    cert_path.write_bytes(pair.cert_pem)


def make_local_pki(
    out_dir: str | os.PathLike[str],
    *,
    clusters: Sequence[str] = ("cluster-a",),
    shards: Sequence[str] = ("shard-0",),
    hosts: Sequence[str] = DEFAULT_HOSTS,
    days: int = 365,
    reuse_ca: bool = True,
) -> dict[str, Path]:
    """Create (or extend) a local PKI in ``out_dir`` — what ``bigfleetctl certs`` runs.

    Writes ``ca.crt``/``ca.key`` (reused when present and ``reuse_ca``), then one
    ``<stem>.crt``/``<stem>.key`` pair per identity: ``admin``, ``readonly``, every
    ``cluster-<id>`` and every ``shard-<id>``. Returns a map of logical name → path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ca_crt, ca_key = out / "ca.crt", out / "ca.key"
    if reuse_ca and ca_crt.exists() and ca_key.exists():
        ca = KeyPair(ca_crt.read_bytes(), ca_key.read_bytes())
    else:
        ca = generate_ca()
        write_pair(ca, ca_crt, ca_key)
    written: dict[str, Path] = {"ca.crt": ca_crt, "ca.key": ca_key}
    identities = [Identity(Role.ADMIN), Identity(Role.READONLY)]
    identities += [Identity(Role.CLUSTER, c) for c in clusters]
    identities += [Identity(Role.SHARD, s) for s in shards]
    start = _utcnow() - _BACKDATE
    for ident in identities:
        stem = identity_file_stem(ident)
        pair = issue_certificate(
            ca, ident, hosts=hosts, not_before=start, not_after=start + dt.timedelta(days=days)
        )
        crt, key = out / f"{stem}.crt", out / f"{stem}.key"
        write_pair(pair, crt, key)
        written[f"{stem}.crt"] = crt
        written[f"{stem}.key"] = key
    return written


def _split(values: Sequence[str]) -> list[str]:
    return [v for item in values for v in item.split(",") if v]


def build_parser(prog: str = "python -m bigfleet.security.certs") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="make a CA and per-role certificates for local use")
    p.add_argument("--out", required=True, help="directory to write ca.crt and <identity>.crt/.key into")
    p.add_argument("--cluster", action="append", default=[], help="cluster id (repeatable or comma list)")
    p.add_argument("--shard", action="append", default=[], help="shard id (repeatable or comma list)")
    p.add_argument(
        "--host", action="append", default=[], help="DNS name or IP the servers are dialled by (default localhost, 127.0.0.1, ::1)"
    )
    p.add_argument("--days", type=int, default=365, help="leaf validity in days")
    p.add_argument("--new-ca", action="store_true", help="replace an existing CA in --out")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry (also what ``bigfleetctl certs`` delegates to)."""
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    clusters = _split(ns.cluster) or ["cluster-a"]
    shards = _split(ns.shard) or ["shard-0"]
    try:
        for ident in [Identity(Role.CLUSTER, c) for c in clusters] + [Identity(Role.SHARD, s) for s in shards]:
            Identity.parse(ident.uri)  # reject ids that would not round-trip
    except ValueError as exc:
        print(f"certs: {exc}", file=sys.stderr)
        return 2
    if ns.days <= 0:
        print("certs: --days must be positive", file=sys.stderr)
        return 2
    try:
        written = make_local_pki(
            ns.out,
            clusters=clusters,
            shards=shards,
            hosts=_split(ns.host) or DEFAULT_HOSTS,
            days=ns.days,
            reuse_ca=not ns.new_ca,
        )
    except OSError as exc:  # --out not creatable or writable, an unreadable CA in it: a usage error
        print(f"certs: cannot write {exc.filename or ns.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    for name in sorted(written):
        print(written[name])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
