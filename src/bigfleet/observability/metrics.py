"""Prometheus registry and exposition shared by the daemons.

Each daemon builds its metrics on its own registry (not the global one) so
that several daemons in one process (all-in-one, tests) never collide on
metric names, and serves it on ``--metrics-listen``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import MetricsHandler


def new_registry(process_metrics: bool = False) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=True)
    if process_metrics:
        ProcessCollector(registry=reg)
    return reg


@dataclass
class MetricsServer:
    server: ThreadingHTTPServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def parse_host_port(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def start_metrics_server(listen: str, registry: CollectorRegistry) -> MetricsServer:
    """Serve /metrics for ``registry`` on ``listen`` (HOST:PORT; port 0 picks one) in a daemon thread."""
    host, port = parse_host_port(listen)
    handler = MetricsHandler.factory(registry)
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return MetricsServer(server, thread)
