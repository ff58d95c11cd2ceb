from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bigfleet.testing import ManagedProcess, free_port, wait_for_health


def start_fake(tmp_path: Path, *args: str, name: str = "fake-provider", env: dict[str, str] | None = None,
               port: int | None = None) -> tuple[ManagedProcess, str]:
    port = port or free_port()
    target = f"127.0.0.1:{port}"
    proc = ManagedProcess.bigfleet(["fake-provider", "--listen", target, *args], name, env=env, log_dir=tmp_path)
    proc.start()
    try:
        wait_for_health(target, timeout=60)
    except Exception:
        proc.stop()
        raise AssertionError(f"fake provider did not become healthy:\n{proc.logs()}") from None
    return proc, target


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def fake_provider(tmp_path: Path) -> Iterator[str]:
    proc, target = start_fake(tmp_path, "--seed-count", "32", "--committed-count", "4")
    yield target
    proc.stop()
