"""Name lookups for pysyncobj that never block the event loop.

pysyncobj resolves a peer's host name each time it (re)connects, with a blocking ``getaddrinfo``.
Its ticks run on the daemon's event loop (raft/looptick.py), so a slow or failing DNS server would
stall every Session and RPC of the daemon. Names are looked up once, blocking, when a member is
built (before it serves anything); after that a lookup that is due runs on a short-lived thread
and pysyncobj gets the addresses known so far (none yet: it retries its connection shortly).
"""

from __future__ import annotations

import ipaddress
import random
import socket
import threading
import time
from collections.abc import Iterable

from pysyncobj import dns_resolver
from pysyncobj.dns_resolver import DnsCachingResolver

from bigfleet.observability import get_logger

log = get_logger("bigfleet.raft.dns")


def _literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


class BackgroundResolver(DnsCachingResolver):  # type: ignore[misc]
    """pysyncobj's resolver interface; answers from what it knows and refreshes on a thread."""

    def __init__(self, ttl: float = 600.0, retry: float = 1.0) -> None:
        super().__init__(ttl, retry)
        self.ttl = ttl
        self.retry = retry  # a name that did not resolve (a peer whose pod is not up yet) is tried again soon
        self._lock = threading.Lock()
        self._known: dict[str, tuple[float, list[str], bool]] = {}  # host -> (when, addresses, resolved)
        self._inflight: set[str] = set()

    def setTimeouts(self, cacheTime: float, failCacheTime: float) -> None:
        """(pysyncobj's defaults would cache a failure for 30 s; ours are kept)"""

    def prime(self, hosts: Iterable[str]) -> None:
        """Look these names up now, blocking: for a member being built, before it serves."""
        for host in hosts:
            if not _literal(host):
                self._store(host, self._lookup(host))

    def resolve(self, hostname: str) -> str | None:
        if _literal(hostname):
            return hostname.strip("[]")
        with self._lock:
            when, addrs, ok = self._known.get(hostname, (-1e18, [], False))
        if time.monotonic() - when > (self.ttl if ok else self.retry):
            self._refresh(hostname)
        return random.choice(addrs) if addrs else None

    def _refresh(self, host: str) -> None:
        with self._lock:
            if host in self._inflight:
                return
            self._inflight.add(host)
        threading.Thread(target=self._refresh_now, args=(host,), name="raft-dns", daemon=True).start()

    def _refresh_now(self, host: str) -> None:
        try:
            self._store(host, self._lookup(host))
        finally:
            with self._lock:
                self._inflight.discard(host)

    def _store(self, host: str, addrs: list[str]) -> None:
        with self._lock:
            seen = self._known.get(host)
            before, was_ok = (seen[1], seen[2]) if seen is not None else ([], True)
            # (a failed refresh keeps the addresses it had: a DNS hiccup must not cut a healthy peer off)
            self._known[host] = (time.monotonic(), addrs or before, bool(addrs))
        if not addrs and was_ok:  # (said once per outage, not at every retry)
            log.warning("raft peer name does not resolve (retried in the background)", host=host, every_s=self.retry)
        elif addrs and not was_ok:
            log.info("raft peer name resolves again", host=host, addresses=addrs)

    @staticmethod
    def _lookup(host: str) -> list[str]:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            return []
        v4 = sorted({str(i[4][0]) for i in infos if i[0] == socket.AF_INET})
        return v4 or sorted({str(i[4][0]) for i in infos})


_RESOLVER = BackgroundResolver()


def install(hosts: Iterable[str]) -> BackgroundResolver:
    """Make ours pysyncobj's process-wide resolver and look ``hosts`` up now (blocking)."""
    dns_resolver._g_resolver = _RESOLVER
    _RESOLVER.prime(hosts)
    return _RESOLVER
