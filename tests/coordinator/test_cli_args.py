"""`bigfleet coordinator` start-up checks that need no running daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigfleet.coordinator.cli import build_parser, main


def test_refuses_to_start_without_a_raft_password(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.delenv("BIGFLEET_RAFT_PASSWORD", raising=False)
    assert main(["--data-dir", str(tmp_path)]) == 2
    assert "Raft password is required" in capsys.readouterr().err


def test_refuses_a_raft_password_shorter_than_16_characters(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setenv("BIGFLEET_RAFT_PASSWORD", "x" * 15)
    assert main(["--data-dir", str(tmp_path)]) == 2
    assert "shorter than 16 characters" in capsys.readouterr().err


def test_partial_tls_flags_are_a_startup_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BIGFLEET_RAFT_PASSWORD", "x" * 16)
    with pytest.raises(SystemExit) as ei:
        main(["--data-dir", str(tmp_path), "--tls-cert", str(tmp_path / "c.pem")])
    assert ei.value.code == 2


def test_flag_aliases_match_the_upstream_and_chart_names() -> None:
    ns = build_parser().parse_args(["--id", "n1", "--metrics-addr", ":8790", "--bootstrap", "--raft-peers", "a:1,b:2"])
    assert (ns.node_id, ns.metrics_listen, ns.raft_peers) == ("n1", ":8790", "a:1,b:2")
    ns = build_parser().parse_args(["--node-id", "n2", "--metrics-listen", "0.0.0.0:1"])
    assert (ns.node_id, ns.metrics_listen) == ("n2", "0.0.0.0:1")


def test_restore_reports_a_missing_archive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["restore", "--archive", str(tmp_path / "nope.tar"), "--data-dir", str(tmp_path / "d")]) == 1
    assert "restore failed" in capsys.readouterr().err


def test_bigfleetctl_certs_delegates_to_the_security_module(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bigfleet.ctl.main import main as ctl

    assert ctl(["certs", "--out", str(tmp_path / "pki"), "--shard", "shard-0"]) == 0
    assert (tmp_path / "pki" / "ca.crt").exists() and (tmp_path / "pki" / "shard-shard-0.crt").exists()
    assert ctl([]) == 0 and "rebalance" in capsys.readouterr().out


def test_raft_election_max_above_one_second_is_a_clear_startup_error(tmp_path: Path) -> None:
    """pysyncobj asserts connectionTimeout (1 s) >= raftMaxTimeout: the flag is refused up front, exit 2."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "BIGFLEET_RAFT_PASSWORD": "a-long-enough-raft-password"}
    p = subprocess.run(
        [sys.executable, "-m", "bigfleet.cli.main", "coordinator", "--raft-election-max", "1.5",
         "--data-dir", str(tmp_path / "d"), "--listen", "127.0.0.1:0", "--raft-bind", "127.0.0.1:0",
         "--log-level", "warning"],
        capture_output=True, text=True, timeout=60, env=env)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--raft-election-max must be at most 1 s, got 1.5" in p.stderr
    assert "AssertionError" not in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "d").exists()  # refused before anything started


@pytest.mark.parametrize(("flags", "message"), [
    (["--raft-election-min", "0.7", "--raft-election-max", "0.6"], "--raft-election-max must be above --raft-election-min"),
    (["--raft-election-min", "0.1"], "--raft-election-min must be above 3 heartbeat periods (0.15 s), got 0.1"),
    (["--raft-election-max", "inf"], "--raft-election-max must be a finite number"),
    (["--raft-compaction-entries", "1"], "--raft-compaction-entries must be at least 2, got 1"),
])
def test_other_raft_flags_pysyncobj_would_assert_on(flags: list[str], message: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BIGFLEET_RAFT_PASSWORD", "a-long-enough-raft-password")
    with pytest.raises(SystemExit) as ei:
        main(["--data-dir", str(tmp_path / "d"), *flags])
    assert ei.value.code == 2
    assert message in capsys.readouterr().err
