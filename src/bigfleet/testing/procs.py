"""Real processes for end-to-end tests: free ports, start/stop/kill, wait on conditions.

Tests wait on conditions (a health check answering, a predicate turning true)
with a deadline instead of sleeping, so they are as fast as the system and
fail with a clear message when it is not.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0, read, release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # the predicate may fail while a daemon starts
            last_exc = exc
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc!r})" if last_exc else ""))
        time.sleep(interval)


def health_status(target: str, service: str = "", timeout: float = 1.0) -> int:
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return int(resp.status)


def wait_for_health(target: str, timeout: float = 20.0, service: str = "") -> None:
    """Wait until the gRPC health service at ``target`` answers SERVING."""
    wait_until(
        lambda: health_status(target, service) == health_pb2.HealthCheckResponse.SERVING,
        timeout,
        interval=0.1,
        what=f"gRPC health SERVING at {target}",
    )


class ManagedProcess:
    """A daemon started as ``python -m bigfleet.cli.main <args>`` (or any argv), logs captured to a file."""

    def __init__(self, argv: Sequence[str], name: str, env: dict[str, str] | None = None, log_dir: Path | None = None) -> None:
        self.argv = list(argv)
        self.name = name
        self.env = {**os.environ, **(env or {})}
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="bigfleet-test-"))
        self.log_path = self.log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def bigfleet(cls, args: Sequence[str], name: str, **kw: object) -> ManagedProcess:
        return cls([sys.executable, "-m", "bigfleet.cli.main", *args], name, **kw)  # type: ignore[arg-type]

    def start(self) -> ManagedProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.proc is not None and self.alive():
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if self.proc is None:
            return None
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
