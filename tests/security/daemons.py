"""Real daemon processes under mTLS for the security end-to-end tests."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bigfleet.security import TLSConfig, dial_sync
from bigfleet.testing import ManagedProcess, free_port


def tls_flags(root: Path, name: str) -> list[str]:
    return ["--tls-cert", str(root / f"{name}.crt"), "--tls-key", str(root / f"{name}.key"), "--tls-ca", str(root / "ca.crt")]


def client(root: Path, name: str) -> TLSConfig:
    return TLSConfig.from_paths(root / f"{name}.crt", root / f"{name}.key", root / "ca.crt")


def wait_tls_health(addr: str, tls: TLSConfig, proc: ManagedProcess, timeout: float = 90.0) -> None:
    """Wait for SERVING over mTLS; fail at once (with the log) if the process exits."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited before serving:\n{proc.logs()[-3000:]}")
        try:
            with dial_sync(addr, tls) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError as exc:
            last = exc
        time.sleep(0.2)
    raise TimeoutError(f"no mTLS health SERVING at {addr} after {timeout}s ({last!r})\n--- {proc.name} log ---\n"
                       f"{proc.logs()[-3000:]}")


def start_provider(root: Path, cert: str = "readonly", *extra: str) -> tuple[ManagedProcess, str]:
    addr = f"127.0.0.1:{free_port()}"
    proc = ManagedProcess.bigfleet(
        ["fake-provider", "--listen", addr, "--log-format", "console", *tls_flags(root, cert), *extra], "provider"
    ).start()
    wait_tls_health(addr, client(root, "admin"), proc)
    return proc, addr


def start_shard(root: Path, provider: str, shard_id: str = "shard-0", *extra: str) -> tuple[ManagedProcess, str]:
    addr = f"127.0.0.1:{free_port()}"
    proc = ManagedProcess.bigfleet(
        ["shard", "--shard-id", shard_id, "--listen", addr, "--provider", provider,
         "--data-dir", tempfile.mkdtemp(prefix="bigfleet-sec-shard-"), "--cycle-interval", "0.5",
         "--log-format", "console", *tls_flags(root, shard_id), *extra],
        "shard",
    ).start()
    wait_tls_health(addr, client(root, "admin"), proc)
    return proc, addr


def start_coordinator(root: Path, *extra: str) -> tuple[ManagedProcess, str]:
    addr = f"127.0.0.1:{free_port()}"
    raft = f"127.0.0.1:{free_port()}"
    proc = ManagedProcess.bigfleet(
        ["coordinator", "--node-id", "node-1", "--listen", addr, "--raft-bind", raft,
         "--data-dir", tempfile.mkdtemp(prefix="bigfleet-sec-coord-"), "--log-format", "console",
         *tls_flags(root, "admin"), *extra],
        "coordinator",
        env={"BIGFLEET_RAFT_PASSWORD": "security-e2e-password-0123456789"},
    ).start()
    wait_tls_health(addr, client(root, "admin"), proc)
    return proc, addr


def code_of(fn: object) -> grpc.StatusCode:
    """Run a zero-argument callable doing one RPC; its status code (OK when it returns)."""
    try:
        fn()  # type: ignore[operator]
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        return code
    return grpc.StatusCode.OK
