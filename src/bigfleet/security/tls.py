"""mTLS configuration shared by every daemon and client: flags, credentials, rotation.

Three flags on every binary — ``--tls-cert``, ``--tls-key``, ``--tls-ca`` — all or none
(protocols.md §8). With them, servers require and verify client certificates against the CA
bundle and clients verify servers against the same bundle; without them everything is
plaintext and identity checks are skipped.

Rotation: the server re-stats the leaf certificate and key on every handshake (gRPC's dynamic
certificate fetcher) and switches when either modification time changes, but only once the
pair loads together and the key matches the certificate, so a half-written rotation keeps the
old pair serving. The CA bundle is read once at start; rotating it needs a restart.

TLS 1.3: grpcio exposes no minimum-version knob, so the negotiated version is enforced per
call instead (:func:`bigfleet.security.roles.check_transport`): a peer that negotiated TLS 1.2
is answered PERMISSION_DENIED.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from bigfleet.observability import get_logger
from bigfleet.rpc import channel_options

log = get_logger("bigfleet.security.tls")


class TLSConfigError(ValueError):
    """The TLS flags or files are unusable; daemons turn this into a startup error."""


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--tls-cert/--tls-key/--tls-ca`` (and the optional ``--tls-server-name``)."""
    g = parser.add_argument_group("mTLS (all three or none)")
    g.add_argument("--tls-cert", default="", help="PEM certificate (chain) of this process")
    g.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default="", help="PEM CA bundle peers are verified against")
    g.add_argument(
        "--tls-server-name",
        default="",
        help="name to verify in servers' certificates instead of the dialled host (optional)",
    )


def load_pair(cert_path: Path, key_path: Path) -> tuple[bytes, bytes]:
    """Read and cross-check a certificate chain and key; raises TLSConfigError."""
    try:
        cert_pem = cert_path.read_bytes()
        key_pem = key_path.read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"cannot read TLS pair: {exc}") from None
    try:
        certs = x509.load_pem_x509_certificates(cert_pem)
    except ValueError as exc:
        raise TLSConfigError(f"{cert_path}: not a PEM certificate: {exc}") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TLSConfigError(f"{key_path}: not an unencrypted PEM private key: {exc}") from None
    leaf_pub = certs[0].public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    key_pub = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    if leaf_pub != key_pub:
        raise TLSConfigError(f"{key_path} does not match the certificate in {cert_path}")
    return cert_pem, key_pem


def load_ca(ca_path: Path) -> bytes:
    try:
        pem = ca_path.read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"cannot read CA bundle: {exc}") from None
    try:
        x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise TLSConfigError(f"{ca_path}: not a PEM CA bundle: {exc}") from None
    return pem


def _mtimes(cert_path: Path, key_path: Path) -> tuple[int, int] | None:
    try:
        return cert_path.stat().st_mtime_ns, key_path.stat().st_mtime_ns
    except OSError:
        return None


@dataclass
class KeyPairReloader:
    """Serves the current leaf pair, reloading it when the files' mtimes change.

    Called by gRPC on each handshake, possibly from a core thread, hence the lock. Returns
    ``None`` from :meth:`fetch` when nothing changed, which tells gRPC to keep its config.
    """

    cert_path: Path
    key_path: Path
    ca_pem: bytes
    pair: tuple[bytes, bytes] = field(init=False)
    reloads: int = field(default=0, init=False)
    failures: int = field(default=0, init=False)
    _seen: tuple[int, int] | None = field(default=None, init=False)
    _bad: tuple[int, int] | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self._seen = _mtimes(self.cert_path, self.key_path)
        self.pair = load_pair(self.cert_path, self.key_path)

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        cert_pem, key_pem = self.pair
        return grpc.ssl_server_certificate_configuration([(key_pem, cert_pem)], root_certificates=self.ca_pem)

    def poll(self) -> bool:
        """Reload if the files changed and load cleanly; True when a new pair was taken."""
        with self._lock:
            now = _mtimes(self.cert_path, self.key_path)
            if now is None or now == self._seen:
                return False  # a failed stat keeps the cached pair
            try:
                pair = load_pair(self.cert_path, self.key_path)
            except TLSConfigError as exc:
                if now != self._bad:  # log once per distinct broken state, not per handshake
                    self._bad = now
                    self.failures += 1
                    log.warning("tls_reload_failed_keeping_old_pair", error=str(exc))
                return False
            self.pair, self._seen, self._bad = pair, now, None
            self.reloads += 1
            log.info("tls_certificate_reloaded", cert=str(self.cert_path), reloads=self.reloads)
            return True

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            return self.configuration() if self.poll() else None
        except Exception:  # never let a rotation problem break the handshake path
            log.exception("tls_fetch_failed")
            return None


@dataclass(frozen=True)
class TLSConfig:
    """Paths of this process's leaf pair and the CA bundle, validated at construction."""

    cert_file: Path
    key_file: Path
    ca_file: Path
    server_name: str = ""

    @classmethod
    def from_paths(
        cls,
        cert: str | os.PathLike[str],
        key: str | os.PathLike[str],
        ca: str | os.PathLike[str],
        server_name: str = "",
    ) -> TLSConfig:
        cfg = cls(Path(cert), Path(key), Path(ca), server_name)
        load_pair(cfg.cert_file, cfg.key_file)
        load_ca(cfg.ca_file)
        return cfg

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> TLSConfig | None:
        """``None`` for plaintext; raises TLSConfigError for a partial or unusable set."""
        values = {
            "--tls-cert": getattr(ns, "tls_cert", "") or "",
            "--tls-key": getattr(ns, "tls_key", "") or "",
            "--tls-ca": getattr(ns, "tls_ca", "") or "",
        }
        given = [k for k, v in values.items() if v]
        if not given:
            return None
        if len(given) != 3:
            missing = ", ".join(k for k, v in values.items() if not v)
            raise TLSConfigError(f"mTLS needs --tls-cert, --tls-key and --tls-ca together; missing {missing}")
        return cls.from_paths(
            values["--tls-cert"], values["--tls-key"], values["--tls-ca"], getattr(ns, "tls_server_name", "") or ""
        )

    def ca_pem(self) -> bytes:
        return load_ca(self.ca_file)

    def reloader(self) -> KeyPairReloader:
        return KeyPairReloader(self.cert_file, self.key_file, self.ca_pem())

    def server_credentials(self, reloader: KeyPairReloader | None = None) -> grpc.ServerCredentials:
        """Server credentials that require client certificates and follow leaf rotation."""
        r = reloader or self.reloader()
        return grpc.dynamic_ssl_server_credentials(r.configuration(), r.fetch, require_client_authentication=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client credentials from the current files (a new channel picks up a rotated pair)."""
        cert_pem, key_pem = load_pair(self.cert_file, self.key_file)
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_pem(), private_key=key_pem, certificate_chain=cert_pem
        )

    def channel_options(self, extra: Sequence[tuple[str, Any]] = ()) -> list[tuple[str, Any]]:
        opts = list(extra)
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        return channel_options(opts)


def tls_from_args_or_exit(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> TLSConfig | None:
    """:meth:`TLSConfig.from_args`, reporting a bad set through ``parser.error`` (exit 2)."""
    try:
        return TLSConfig.from_args(ns)
    except TLSConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def normalize_listen(address: str) -> str:
    """Go-style ``:7780`` (all interfaces) becomes ``[::]:7780``, which gRPC Python accepts."""
    return f"[::]{address}" if address.startswith(":") else address


def add_port(server: grpc.aio.Server, address: str, tls: TLSConfig | None) -> int:
    """Bind ``address`` with mTLS when configured, plaintext otherwise; returns the port.

    Raises OSError when the address cannot be bound (gRPC itself raises RuntimeError).
    """
    address = normalize_listen(address)
    port: int
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls.server_credentials())
    except RuntimeError as exc:
        raise OSError(f"cannot bind gRPC address {address!r}: {exc}") from None
    if port == 0:
        raise OSError(f"cannot bind gRPC address {address!r}")
    return port


def dial(target: str, tls: TLSConfig | None, extra: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to ``target``: mTLS with this process's certificate, or plaintext."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=channel_options(extra))
    return grpc.aio.secure_channel(target, tls.channel_credentials(), options=tls.channel_options(extra))


class RotatingChannel:
    """An asyncio channel that is re-dialled when this process's certificate files change.

    gRPC Python's client credentials are static: a long-lived channel keeps presenting the
    certificate it was built with, even after rotation, until that certificate expires. Call
    :meth:`get` per RPC (or per batch): it stats the cert and key (cheap) and, after a rotation
    that loads cleanly, returns a new channel; the old one is closed after ``grace`` seconds so
    calls in flight on it can finish. Plaintext configs never re-dial.
    """

    def __init__(
        self, target: str, tls: TLSConfig | None, extra: Sequence[tuple[str, Any]] = (), grace: float = 30.0
    ) -> None:
        self.target, self.tls, self.extra, self.grace = target, tls, list(extra), grace
        self.redials = 0
        self._seen = _mtimes(tls.cert_file, tls.key_file) if tls else None
        self._channel = dial(target, tls, self.extra)
        self._retiring: set[asyncio.Task[None]] = set()

    def get(self) -> grpc.aio.Channel:
        if self.tls is None:
            return self._channel
        now = _mtimes(self.tls.cert_file, self.tls.key_file)
        if now is None or now == self._seen:
            return self._channel
        try:
            fresh = dial(self.target, self.tls, self.extra)
        except TLSConfigError as exc:  # half-written rotation: keep the old channel for now
            log.warning("tls_client_redial_deferred", target=self.target, error=str(exc))
            return self._channel
        old, self._channel, self._seen = self._channel, fresh, now
        self.redials += 1
        log.info("tls_client_redialled_after_rotation", target=self.target, redials=self.redials)
        task = asyncio.get_running_loop().create_task(self._retire(old))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        return fresh

    async def _retire(self, ch: grpc.aio.Channel) -> None:
        await asyncio.sleep(self.grace)
        await ch.close()

    async def close(self) -> None:
        for t in list(self._retiring):
            t.cancel()
        await self._channel.close()


def dial_sync(target: str, tls: TLSConfig | None, extra: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """Blocking-API twin of :func:`dial` for CLIs such as bigfleetctl."""
    if tls is None:
        return grpc.insecure_channel(target, options=channel_options(extra))
    return grpc.secure_channel(target, tls.channel_credentials(), options=tls.channel_options(extra))
