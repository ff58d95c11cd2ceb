"""The `bigfleet` dispatcher lists every subcommand and refuses unknown ones."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from bigfleet.cli.main import SUBCOMMANDS, main
from bigfleet.testing import free_port


def test_help_lists_every_subcommand(capsys: object) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    for name in ("shard", "coordinator", "operator", "fake-provider", "pod-controller", "all-in-one", "conformance"):
        assert name in out
        assert name in SUBCOMMANDS


def test_unknown_subcommand_is_an_error() -> None:
    assert main(["no-such-thing"]) == 2


def test_console_script_runs() -> None:
    for module in ("bigfleet.cli.main", "bigfleet"):  # (`python -m bigfleet` too)
        proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True)
        assert proc.returncode == 0, (module, proc.stderr)
        assert "subcommands" in proc.stdout
    assert subprocess.run([sys.executable, "-m", "bigfleet", "no-such-thing"], capture_output=True).returncode == 2


def _busy_port() -> tuple[socket.socket, str]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, f"127.0.0.1:{s.getsockname()[1]}"


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bigfleet.cli.main", *args], capture_output=True, text=True,
                          timeout=60, check=False, env={**os.environ, **(env or {})})


def test_a_port_in_use_is_a_clear_start_up_error(tmp_path: Path) -> None:
    """A busy gRPC port, and a busy Raft port (pysyncobj only logged that one, so the member ran outside
    any group while looking healthy), stop the daemon with a one-line error and no traceback."""
    sock, busy = _busy_port()
    with sock:
        runs = {
            "fake-provider --listen": _run(["fake-provider", "--listen", busy]),
            "coordinator --listen": _run(["coordinator", "--node-id", "n0", "--listen", busy, "--raft-bind",
                                          f"127.0.0.1:{free_port()}", "--data-dir", str(tmp_path / "c1")],
                                         {"BIGFLEET_RAFT_PASSWORD": "a-long-enough-password"}),
            "coordinator --raft-bind": _run(["coordinator", "--node-id", "n0", "--listen", f"127.0.0.1:{free_port()}",
                                             "--raft-bind", busy, "--data-dir", str(tmp_path / "c2")],
                                            {"BIGFLEET_RAFT_PASSWORD": "a-long-enough-password"}),
            "shard --raft-bind": _run(["shard", "--shard-id", "s1", "--listen", f"127.0.0.1:{free_port()}",
                                       "--provider", f"127.0.0.1:{free_port()}", "--data-dir", str(tmp_path / "s"),
                                       "--replica-id", "r0", "--raft-bind", busy, "--raft-peers",
                                       f"127.0.0.1:{free_port()}", "--raft-password", "a-long-enough-password"]),
        }
    for what, r in runs.items():
        out = r.stdout + r.stderr
        assert r.returncode != 0, (what, out)
        assert "Traceback" not in out, (what, out)
        assert busy in out, (what, out)


def test_bigfleetctl_refuses_a_timeout_that_is_not_a_positive_number() -> None:
    for bad in ("-1", "0", "nan", "inf", "soon"):
        r = subprocess.run([sys.executable, "-m", "bigfleet.ctl.main", "shards", "--timeout", bad],
                           capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 2 and "--timeout" in r.stderr, (bad, r.stderr)
