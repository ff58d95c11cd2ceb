"""`bigfleet all-in-one` as a new user runs it: a real subprocess, no TTY, ends by itself with a summary."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bigfleet.cli.main", "all-in-one", *args],
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_in_one_runs_a_fleet_prints_a_summary_and_restarts_a_daemon_that_died() -> None:
    """One run covers both: the fleet and its summary, and the supervisor restarting the provider it
    lost (SIGKILL right after "fleet up:"; the provider keeps its state file, so the fleet goes on)."""
    import os
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "bigfleet.cli.main", "all-in-one", "--clusters", "3",
                             "--duration", "20", "--print-every", "5"],
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
        rest, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines) + rest
    assert proc.returncode == 0, out + err
    assert "supervisor: provider exited; restarted it" in out, out
    assert "daemon restarts: provider 1" in out, out
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
@pytest.mark.heavy  # (the scenario engine and cut-offs: tests/sim in-process; the all-in-one runs below)
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


def _wait_for(predicate: Callable[[], T], timeout: float, what: str) -> T:
    import time

    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
            last = value
        except Exception as exc:  # not yet: keep the reason for the failure message
            last = exc
        time.sleep(0.3)
    raise AssertionError(f"{what} not true after {timeout:g}s (last: {last!r})")


def _ctl(command: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """Run one of the bigfleetctl commands the all-in-one printed, exactly as printed (plus ``extra``)."""
    return subprocess.run([*shlex.split(command), *extra], capture_output=True, text=True, timeout=60,
                          stdin=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("tls", ["plaintext", pytest.param("mtls", marks=pytest.mark.heavy)])  # (mTLS all-in-one:
# tests/security/test_tls_conformance_allinone.py, in make test)
def test_all_in_one_places_clusters_through_the_coordinator_and_serves_the_dashboard(tmp_path: Path,
                                                                                     tls: str) -> None:
    """Production wiring: the simulated operators find their shard through the coordinator, so the
    coordinator's bindings, the printed ``bigfleetctl clusters`` / ``needs --cluster`` commands and the
    printed dashboard URL all answer while the all-in-one runs."""
    import asyncio
    import json
    import signal
    import urllib.request

    from bigfleet.coordclient.client import CoordinatorClient
    from bigfleet.security import TLSConfig
    from bigfleet.v1alpha1 import coordinator_pb2 as cpb

    pki = tmp_path / "pki"
    argv = [sys.executable, "-m", "bigfleet.cli.main", "all-in-one", "--clusters", "3", "--duration", "90",
            "--tick", "0.5", "--print-every", "2"]
    if tls == "mtls":
        argv += ["--tls", "auto", "--tls-dir", str(pki)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        commands: list[str] = []
        in_try = False
        for line in proc.stdout:
            lines.append(line)
            if in_try:
                commands.append(line.strip())
                if len(commands) == 4:
                    break
            in_try = in_try or line.startswith("try, while it runs:")
        out = "".join(lines)
        assert len(commands) == 4, out
        up = re.search(r"^fleet up: shard (\S+), coordinator (\S+), provider (\S+); 3 simulated clusters placed "
                       r"through the coordinator", out, re.M)
        dash = re.search(r"^dashboard: (http://127\.0\.0\.1:\d+/)$", out, re.M)
        assert up and dash, out
        coordinator = up.group(2).rstrip(",")
        verbs = ("clusters", "needs", "shards", "inventory")
        by_verb = {next(w for w in shlex.split(c) if w in verbs): c for c in commands}
        assert set(by_verb) == {"clusters", "needs", "shards", "inventory"}, commands
        assert by_verb["needs"].endswith("needs --cluster cluster-00"), commands
        assert all(f"--coordinator {coordinator} " in c for c in commands), commands
        if tls == "mtls":
            assert all(f"--tls-cert {pki / 'admin.crt'}" in c for c in commands), commands

        # 1. The coordinator placed every cluster on the shard (its own RPC, as the admin).
        admin = TLSConfig.from_paths(pki / "admin.crt", pki / "admin.key", pki / "ca.crt") if tls == "mtls" else None

        async def bindings() -> dict[str, str]:
            c = CoordinatorClient([coordinator], tls=admin)
            try:
                r = await c.call("ListClusterBindings", cpb.ListClusterBindingsRequest())
                return {b.cluster_id: b.shard_id for b in r.bindings}
            finally:
                await c.close()

        want = {f"cluster-{i:02d}": "shard-1" for i in range(3)}
        _wait_for(lambda: asyncio.run(bindings()) == want, 30, "every cluster bound to shard-1")

        # 2. The printed `bigfleetctl clusters` lists them with their shard.
        r = _ctl(by_verb["clusters"], "-o", "json")
        assert r.returncode == 0, r.stdout + r.stderr
        assert {b["cluster_id"]: b["shard_id"] for b in json.loads(r.stdout)} == want, r.stdout
        r = _ctl(by_verb["clusters"])
        assert re.search(r"^cluster-02\s+shard-1\s+1\s", r.stdout, re.M), r.stdout

        # 3. The printed `bigfleetctl needs --cluster cluster-00` answers from the cluster's shard.
        def needs() -> dict[str, Any] | None:
            r = _ctl(by_verb["needs"], "-o", "json")
            assert r.returncode == 0, r.stdout + r.stderr
            data: dict[str, Any] = json.loads(r.stdout)
            return data if data["cycle"] and data["needs"] else None

        data = _wait_for(needs, 30, "cluster-00's needs on its shard")
        assert data["shard_id"] == "shard-1", data
        assert {n["cluster_id"] for n in data["needs"]} == {"cluster-00"}, data
        r = _ctl(by_verb["needs"])
        assert r.returncode == 0 and re.search(r"^shard shard-1, cycle \d+: \d+ shown of \d+ needs$", r.stdout, re.M), \
            r.stdout + r.stderr
        r = _ctl(by_verb["shards"])
        assert r.returncode == 0 and re.search(r"^shard-1\s+\S+\s+up\s.*\s3\s", r.stdout, re.M), r.stdout + r.stderr

        # 4. The printed dashboard URL serves the page and its JSON.
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with no_proxy.open(dash.group(1), timeout=10) as resp:
            assert resp.status == 200 and "text/html" in resp.headers["Content-Type"]
        with no_proxy.open(dash.group(1) + "api/fleet", timeout=10) as resp:
            assert resp.status == 200 and isinstance(json.loads(resp.read()), dict)

        # 5. The plain status line (every 2 s here) counts every cluster connected and bound. The checks
        # above can finish before the first one is printed, so read on until it is.
        for line in proc.stdout:
            lines.append(line)
            if re.search(r"clusters connected=3 bound=3 ", line):
                break

        # 6. Ctrl-C ends it early with the summary, which counts the bindings too.
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        out = "".join(lines) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, out
    assert "coordinator: leader, 1 shard(s) registered, 3 of 3 clusters bound" in out, out
    assert re.search(r"clusters connected=3 bound=3 ", out), out
    assert "result: OK" in out, out
