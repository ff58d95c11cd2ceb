"""`bigfleet shard` start-up failures are explicit and fast (no half-started daemon)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bigfleet.shard.config import load_settings

pytestmark = pytest.mark.timeout(120)


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bigfleet.cli.main", "shard", *args], capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.mark.slow
def test_missing_provider_and_bad_addresses_exit_2() -> None:
    r = run("--listen", "127.0.0.1:0")
    assert r.returncode == 2 and "--provider" in r.stderr
    r = run("--listen", "nonsense", "--provider", "127.0.0.1:1")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr
    r = run("--provider", "127.0.0.1:1", "--tls-cert", "x.crt")
    assert r.returncode != 0


@pytest.mark.slow
def test_corrupt_epoch_file_is_fatal(tmp_path: Path) -> None:
    (tmp_path / "epoch").write_text("garbage")
    r = run("--listen", "127.0.0.1:0", "--provider", "127.0.0.1:1", "--data-dir", str(tmp_path), "--log-format", "console")
    assert r.returncode == 1 and "epoch" in (r.stderr + r.stdout)


def test_settings_precedence_file_env_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "shard.yaml"
    f.write_text("cycle-interval: 3\nbootstrap_timeout: 7\nshard_id: from-file\n")
    monkeypatch.setenv("BIGFLEET_SHARD_BOOTSTRAP_TIMEOUT", "9")
    s = load_settings(str(f), {"shard_id": "from-flag", "cycle_interval": None})
    assert (s.cycle_interval, s.bootstrap_timeout, s.shard_id) == (3.0, 9.0, "from-flag")
    with pytest.raises(ValueError):
        load_settings(None, {"cycle_interval": -1.0})
