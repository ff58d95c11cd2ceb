"""The `bigfleet` dispatcher lists every subcommand and refuses unknown ones."""

from __future__ import annotations

import subprocess
import sys

from bigfleet.cli.main import SUBCOMMANDS, main


def test_help_lists_every_subcommand(capsys: object) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    for name in ("shard", "coordinator", "operator", "fake-provider", "pod-controller", "all-in-one", "conformance"):
        assert name in out
        assert name in SUBCOMMANDS


def test_unknown_subcommand_is_an_error() -> None:
    assert main(["no-such-thing"]) == 2


def test_console_script_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "bigfleet.cli.main", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert "subcommands" in proc.stdout
