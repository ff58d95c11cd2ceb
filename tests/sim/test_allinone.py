"""`bigfleet all-in-one` as a new user runs it: a real subprocess, no TTY, ends by itself with a summary."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bigfleet.cli.main", "all-in-one", *args],
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_in_one_runs_a_fleet_and_prints_a_summary() -> None:
    r = _run("--clusters", "3", "--duration", "20", "--print-every", "5")
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "fleet up:" in out
    assert re.search(r"^\[\s*\d+\.\ds\] cycle=\d+ machines=\d+", out, re.M), out  # plain lines without a TTY
    assert "=== BigFleet all-in-one summary ===" in out
    assert "double-assigned machines: 0" in out and "result: OK" in out
    assert "coordinator: leader, 1 shard(s) registered" in out, out
    m = re.search(r"actions: Create (\d+), Configure (\d+), Drain (\d+), Delete (\d+)", out)
    assert m and int(m.group(2)) > 0, out
    configured = re.search(r"configured in clusters (\d+)", out)
    assert configured and int(configured.group(1)) > 0, out
    cycles = re.search(r"ran \d+s: (\d+) shard cycles", out)
    assert cycles and int(cycles.group(1)) > 3, out
    inv = re.search(r"inventory: .*configured (\d+).*\(total (\d+)\)", out)
    assert inv and int(inv.group(2)) > 0 and int(inv.group(1)) > 0, out


def test_all_in_one_refuses_a_bad_scenario_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("clusters: {a: [{name: w, pods: 2}]}\ncylces: 3\n")
    r = _run("--scenario", str(bad), timeout=60)
    assert r.returncode == 2 and "unknown keys" in r.stderr
    r = _run("--duration", "0", timeout=60)
    assert r.returncode == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_in_one_runs_a_scenario_file_with_an_operator_cut_off(tmp_path: Path) -> None:
    sc = tmp_path / "two.yaml"
    sc.write_text(
        "inventory: {committed: 6, speculative: 4}\n"
        "clusters:\n"
        "  alpha:\n    - {name: web, pods: 4, cpu: 3, priority: 1000}\n"
        "  beta:\n    - {name: api, pods: 2, cpu: 3, priority: 500}\n"
        "faults:\n  - {at: 4, kind: disconnect, cluster: beta}\n  - {at: 14, kind: reconnect, cluster: beta}\n"
    )
    r = _run("--scenario", str(sc), "--duration", "16", "--tick", "0.5", "--print-every", "1")
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert re.search(r"clusters connected=1 ", out), out  # beta was cut off for a while
    assert "operator reconnects 1" in out, out
    m = re.search(r"inventory: .*\(total (\d+)\)", out)
    assert m and int(m.group(1)) == 10, out
    configured = re.search(r"configured in clusters (\d+)", out)
    assert configured and int(configured.group(1)) == 3, out  # alpha 2 machines, beta 1 (back after the cut)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_in_one_restarts_a_daemon_that_died() -> None:
    import os
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "bigfleet.cli.main", "all-in-one", "--clusters", "2",
                             "--duration", "20", "--print-every", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("fleet up:"):
                break
        children = _children(proc.pid)
        provider = [pid for pid, cmd in children if "fake-provider" in cmd]
        assert len(provider) == 1, children
        os.kill(provider[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
        out = "".join(lines) + out
        assert proc.returncode == 0, out + err
        assert "supervisor: provider exited; restarted it" in out, out
        assert "daemon restarts: provider 1" in out and "result: OK" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _children(pid: int) -> list[tuple[int, str]]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                out.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, ValueError, IndexError):
            continue
    return out
