"""`bigfleet coordinator` start-up checks that need no running daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

from bigfleet.coordinator.cli import build_parser, main


def test_refuses_to_start_without_a_raft_password(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.delenv("BIGFLEET_RAFT_PASSWORD", raising=False)
    assert main(["--data-dir", str(tmp_path)]) == 2
    assert "Raft password is required" in capsys.readouterr().err


def test_partial_tls_flags_are_a_startup_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BIGFLEET_RAFT_PASSWORD", "x")
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
