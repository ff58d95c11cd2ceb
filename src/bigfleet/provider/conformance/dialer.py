"""How the conformance harness reaches a provider: plaintext, or mTLS.

Under mTLS a provider may pin a shard certificate to the ``shard_id`` its fenced calls carry (the
provider kit does: a shard may only act as itself). The suite fences with many fresh shard ids, so
one certificate cannot speak for all of them. Given the CA's key (``--tls-ca-key``) the dialer issues
a short-lived shard certificate for each shard id it fences with and keeps one channel per id;
without it every call presents ``--tls-cert`` (enough for providers that only verify the CA).
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bigfleet.security import TLSConfig, dial_sync
from bigfleet.security.certs import KeyPair, issue_certificate
from bigfleet.security.identity import Identity, Role
from bigfleet.v1alpha1 import provider_pb2_grpc as pbg

_LEAF_LIFETIME = dt.timedelta(hours=2)
_BACKDATE = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class Transport:
    """What ``--tls-*`` (and ``--tls-ca-key``) asked for; None/None is plaintext."""

    tls: TLSConfig | None = None
    ca_key: Path | None = None

    def dialer(self, target: str) -> Dialer:
        return Dialer(target, self.tls, self.ca_key)


class Dialer:
    def __init__(self, target: str, tls: TLSConfig | None = None, ca_key: Path | None = None) -> None:
        if ca_key is not None and tls is None:
            raise ValueError("--tls-ca-key needs --tls-cert/--tls-key/--tls-ca")
        self.target = target
        self.tls = tls
        self._ca = KeyPair(tls.ca_pem(), ca_key.read_bytes()) if tls is not None and ca_key is not None else None
        self._lock = threading.Lock()
        self._per_shard: dict[str, tuple[grpc.Channel, pbg.CapacityProviderStub]] = {}
        self._owned: list[grpc.Channel] = []

    def channel(self, extra: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel presenting this process's own identity (plaintext without TLS)."""
        ch = dial_sync(self.target, self.tls, extra)
        with self._lock:
            self._owned.append(ch)
        return ch

    def stub_for_shard(self, shard_id: str) -> pbg.CapacityProviderStub | None:
        """A stub that may act as ``shard_id``; None when every call uses the default identity."""
        if self._ca is None or self.tls is None or not shard_id:
            return None
        with self._lock:
            hit = self._per_shard.get(shard_id)
            if hit is not None:
                return hit[1]
            now = dt.datetime.now(dt.UTC)
            pair = issue_certificate(self._ca, Identity(Role.SHARD, shard_id), not_before=now - _BACKDATE,
                                     not_after=now + _LEAF_LIFETIME)
            creds = grpc.ssl_channel_credentials(root_certificates=self._ca.cert_pem, private_key=pair.key_pem,
                                                 certificate_chain=pair.cert_pem)
            ch = grpc.secure_channel(self.target, creds, options=self.tls.channel_options())
            stub = pbg.CapacityProviderStub(ch)
            self._per_shard[shard_id] = (ch, stub)
            return stub

    def close(self) -> None:
        with self._lock:
            channels = [*self._owned, *(ch for ch, _ in self._per_shard.values())]
            self._owned.clear()
            self._per_shard.clear()
        for ch in channels:
            ch.close()
