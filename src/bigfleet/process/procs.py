"""Real processes for end-to-end tests: free ports, start/stop/kill, wait on conditions.

Tests wait on conditions (a health check answering, a predicate turning true)
with a deadline instead of sleeping, so they are as fast as the system and
fail with a clear message when it is not.
"""

from __future__ import annotations

import asyncio
import os
import random
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


_handed_out: set[int] = set()
# Below Linux's default ephemeral range (32768-60999): a port picked there can
# be taken between our probe and the daemon's bind by any outgoing connection's
# local port, which made multi-process tests flaky.
_LOW, _HIGH = 20000, 32767


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago, outside the ephemeral range, never handed out twice by this process."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(2000):
        port = rng.randint(_LOW, _HIGH)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # fall back to the kernel's choice
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


async def wait_until_async(predicate: Callable[[], T], timeout: float, interval: float = 0.05,
                           what: str = "condition") -> T:
    """`wait_until` for a caller on an event loop whose own work (a Raft member, a server) the
    condition depends on: it sleeps on the loop instead of blocking it."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


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

    def wait_healthy(self, target: str, timeout: float = 30.0) -> None:
        """Like wait_for_health, but stop at once, with the log tail, if the process has exited."""

        def ready() -> bool:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode if self.proc else None}; log tail:\n{self.logs()[-3000:]}")
            try:
                return bool(health_status(target) == health_pb2.HealthCheckResponse.SERVING)
            except grpc.RpcError:
                return False

        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {self.name} health SERVING at {target}; log tail:\n{self.logs()[-3000:]}")
            time.sleep(0.1)

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
