"""Who is on the other end of a connection: the ``bigfleet://`` URI SAN of the peer's certificate.

Identity rules (protocols.md §8): a certificate names exactly one ``bigfleet://`` URI SAN —
``cluster/<id>`` (an operator), ``shard/<id>``, ``admin`` or ``readonly``. Other URI schemes
are ignored; zero or several ``bigfleet://`` SANs is an error the caller answers with
PERMISSION_DENIED. Over plaintext there is no identity at all and checks are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import Any, Protocol

from cryptography import x509

SCHEME = "bigfleet://"
MAX_ID_LEN = 253
# An id travels inside a URI, so it is restricted to characters that need no escaping.
_ID_RE = re.compile(r"^[A-Za-z0-9._~-]+$")


class IdentityError(ValueError):
    """The peer presented a certificate, but it does not name exactly one valid identity."""


class Role(StrEnum):
    CLUSTER = "cluster"
    SHARD = "shard"
    ADMIN = "admin"
    READONLY = "readonly"


_NEEDS_ID = frozenset({Role.CLUSTER, Role.SHARD})


@dataclass(frozen=True)
class Identity:
    """A verified peer identity. ``id`` is set for cluster and shard roles only."""

    role: Role
    id: str = ""

    def __post_init__(self) -> None:
        if self.role in _NEEDS_ID:
            if not self.id or len(self.id) > MAX_ID_LEN or not _ID_RE.match(self.id):
                raise IdentityError(f"invalid {self.role.value} id {self.id!r}")
        elif self.id:
            raise IdentityError(f"role {self.role.value} takes no id")

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.role.value}" + (f"/{self.id}" if self.id else "")

    def __str__(self) -> str:
        return self.uri

    @classmethod
    def parse(cls, uri: str) -> Identity:
        """Parse ``bigfleet://<role>[/<id>]``; raises IdentityError on anything else."""
        if not uri.startswith(SCHEME):
            raise IdentityError(f"not a bigfleet identity URI: {uri!r}")
        rest = uri[len(SCHEME) :]
        role_text, sep, ident = rest.partition("/")
        try:
            role = Role(role_text)
        except ValueError:
            raise IdentityError(f"unknown role in {uri!r}") from None
        if role in _NEEDS_ID and not sep:
            raise IdentityError(f"{uri!r} lacks the {role.value} id")
        if role not in _NEEDS_ID and sep:
            raise IdentityError(f"{uri!r}: role {role.value} takes no id")
        return cls(role, ident)


def cluster(cluster_id: str) -> Identity:
    return Identity(Role.CLUSTER, cluster_id)


def shard(shard_id: str) -> Identity:
    return Identity(Role.SHARD, shard_id)


ADMIN = Identity(Role.ADMIN)
READONLY = Identity(Role.READONLY)


def identity_from_uris(uris: Sequence[str]) -> Identity:
    """The single bigfleet identity among a certificate's URI SANs."""
    ours = [u for u in uris if u.lower().startswith(SCHEME)]
    if not ours:
        raise IdentityError("certificate carries no bigfleet:// URI SAN")
    if len(ours) > 1:
        raise IdentityError(f"certificate carries {len(ours)} bigfleet:// URI SANs; exactly one is allowed")
    return Identity.parse(ours[0])


def certificate_uris(cert: x509.Certificate) -> list[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(u) for u in san.get_values_for_type(x509.UniformResourceIdentifier)]


def identity_from_certificate(cert_pem: bytes | x509.Certificate) -> Identity:
    """The identity of a (leaf) certificate, given as PEM or already parsed."""
    if isinstance(cert_pem, x509.Certificate):
        return identity_from_uris(certificate_uris(cert_pem))
    return _identity_from_pem(bytes(cert_pem))


@lru_cache(maxsize=4096)
def _identity_from_pem(pem: bytes) -> Identity:
    # Cached: unary RPCs would otherwise parse the same peer certificate on every call.
    # lru_cache does not cache exceptions, so a bad certificate is re-parsed (and re-denied).
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise IdentityError(f"unparseable peer certificate: {exc}") from None
    return identity_from_uris(certificate_uris(cert))


class _HasAuthContext(Protocol):
    def auth_context(self) -> Mapping[str, Any]: ...


def identity_from_auth_context(auth: Mapping[str, Sequence[bytes]]) -> Identity | None:
    """Pure core of :func:`peer_identity`, driven by tests with hand-made dicts.

    ``None`` means the transport is not TLS (checks are skipped). Under TLS the leaf that
    gRPC verified against our CA is in ``x509_pem_cert``; a TLS peer without one cannot have
    passed a server that requires client certificates, so it is an error, not "anonymous".
    """
    security = [v.decode(errors="replace") for v in auth.get("transport_security_type", [])]
    if "ssl" not in security:
        return None
    pems = list(auth.get("x509_pem_cert", []))
    if len(pems) != 1:
        raise IdentityError("TLS peer presented no client certificate")
    return identity_from_certificate(pems[0])


def peer_identity(context: _HasAuthContext) -> Identity | None:
    """The caller's identity from a grpc(.aio) servicer context; ``None`` over plaintext.

    Raises IdentityError when the peer is on TLS but its certificate names zero or several
    identities (callers answer PERMISSION_DENIED; :mod:`bigfleet.security.roles` does this).
    """
    return identity_from_auth_context(context.auth_context())
