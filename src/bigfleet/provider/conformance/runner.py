"""Runs the conformance lanes against a target and/or providers it launches; reports the results.

Lanes: ``core`` (against ``--target``, or a provider launched from
``--provider-cmd``), ``fault`` (a launched provider with the conformance fault
hooks enabled), ``durability`` (a launched provider with a state file, killed
with SIGKILL and restarted on it) and ``scale`` (thousands of machines).
Lanes that need to launch a provider are skipped, with the reason, when no
command is given.

The command template may use ``{listen}`` (HOST:PORT), ``{host}``, ``{port}``,
``{state_file}`` and ``{seed_count}``; the suite fills them in. Under mTLS (``Params.transport``) the
suite dials every provider, launched or not, with the given certificate; the command must start the
provider with its own server certificate.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc

from bigfleet.process import free_port
from bigfleet.provider.conformance.checks import Check, Ctx, checks_for, durability_before
from bigfleet.provider.conformance.dialer import Transport
from bigfleet.provider.conformance.harness import CheckFailed, Harness, Skip
from bigfleet.provider.kit.faults import ENV_ENABLE, ENV_TIMEOUT

LANES = ("core", "fault", "durability", "scale")
GRACEFUL = "D707"  # runs after a SIGTERM restart, not with the other durability checks


@dataclass
class Result:
    lane: str
    id: str
    title: str
    status: str  # pass | fail | skip
    seconds: float
    detail: str = ""


@dataclass
class Params:
    core_seed: int = 256
    fault_timeout: float = 2.0
    scale_machines: int = 5000
    scale_burst: int = 256
    list_budget: float = 5.0
    rpc_budget: float = 0.25
    settle_timeout: float = 15.0
    start_timeout: float = 60.0
    extra: dict[str, Any] = field(default_factory=dict)
    transport: Transport = field(default_factory=Transport)

    def as_dict(self) -> dict[str, Any]:
        return {"fault_timeout": self.fault_timeout, "scale_machines": self.scale_machines,
                "scale_burst": self.scale_burst, "list_budget": self.list_budget, "rpc_budget": self.rpc_budget,
                **self.extra}


class LaunchError(RuntimeError):
    pass


class Launcher:
    """Starts the provider under test from a command template; kill/stop like an operator would."""

    def __init__(self, template: str, workdir: Path, start_timeout: float = 60.0,
                 transport: Transport | None = None) -> None:
        if "{listen}" not in template and "{port}" not in template:
            raise LaunchError("--provider-cmd must contain {listen} or {port} so the suite can pick the port")
        self.template = template
        self.transport = transport
        self.workdir = workdir
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self.n = 0

    @property
    def has_state(self) -> bool:
        return "{state_file}" in self.template

    def start(self, name: str, seed_count: int, state_file: Path | None = None,
              env: dict[str, str] | None = None) -> str:
        self.n += 1
        port = free_port()
        values = {"listen": f"127.0.0.1:{port}", "host": "127.0.0.1", "port": str(port),
                  "seed_count": str(seed_count),
                  "state_file": str(state_file or self.workdir / f"{name}-{self.n}.state.json")}
        argv = [part.format(**values) for part in shlex.split(self.template)]
        self.log_path = self.workdir / f"{name}-{self.n}.log"
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                     start_new_session=True)
        log.close()
        target = values["listen"]
        h = Harness(target, call_timeout=2.0, transport=self.transport)
        deadline = time.monotonic() + self.start_timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise LaunchError(f"provider exited with {self.proc.returncode} during start-up:\n{self.logs()}")
                try:
                    h.list(max_results=1, timeout=2.0)
                    return target
                except Exception:
                    if time.monotonic() > deadline:
                        self.kill()
                        raise LaunchError(f"provider did not answer List within {self.start_timeout}s:\n"
                                          f"{self.logs()}") from None
                    time.sleep(0.1)
        finally:
            h.close()

    def logs(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:] if self.log_path else ""
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def _run_check(chk: Check, ctx: Ctx) -> Result:
    t0 = time.perf_counter()
    try:
        chk.fn(ctx)
    except Skip as exc:
        return Result(chk.lane, chk.id, chk.title, "skip", time.perf_counter() - t0, str(exc))
    except CheckFailed as exc:
        return Result(chk.lane, chk.id, chk.title, "fail", time.perf_counter() - t0, str(exc))
    except Exception as exc:
        tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
        return Result(chk.lane, chk.id, chk.title, "fail", time.perf_counter() - t0, f"unexpected error: {tb}")
    return Result(chk.lane, chk.id, chk.title, "pass", time.perf_counter() - t0, "")


def _lane_skipped(lane: str, why: str) -> list[Result]:
    return [Result(c.lane, c.id, c.title, "skip", 0.0, why) for c in checks_for(lane)]


def _lane_failed(lane: str, why: str) -> list[Result]:
    return [Result(c.lane, c.id, c.title, "fail", 0.0, why) for c in checks_for(lane)]


def _run_lane(lane: str, target: str, params: Params, shared: dict[str, Any] | None = None,
              only: set[str] | None = None, on_result: Callable[[Result], None] | None = None) -> list[Result]:
    h = Harness(target, settle_timeout=params.settle_timeout, transport=params.transport)
    ctx = Ctx(h, params.as_dict(), shared if shared is not None else {})
    out = []
    try:
        for chk in checks_for(lane):
            if only and chk.id not in only:
                continue
            before = len(ctx.shared.get("report", []))
            r = _run_check(chk, ctx)
            measured = ctx.shared.get("report", [])[before:]
            if r.status == "pass" and measured:
                r.detail = "; ".join(measured)
            out.append(r)
            if on_result:
                on_result(r)
    finally:
        h.close()
    return out


def run_suite(
    target: str | None,
    lanes: Sequence[str],
    provider_cmd: str | None = None,
    params: Params | None = None,
    workdir: Path | None = None,
    only: set[str] | None = None,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    params = params or Params()
    workdir = workdir or Path(tempfile.mkdtemp(prefix="bigfleet-conformance-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []

    def emit(rs: list[Result]) -> None:
        for r in rs:
            if only and r.id not in only:
                continue
            results.append(r)
            if on_result:
                on_result(r)

    def run(lane: str, tgt: str, shared: dict[str, Any] | None = None, ids: set[str] | None = None) -> None:
        def cb(r: Result) -> None:
            results.append(r)
            if on_result:
                on_result(r)

        wanted = ids if only is None else (only if ids is None else ids & only)
        if wanted is not None and not wanted:
            return
        _run_lane(lane, tgt, params, shared, wanted, cb)

    launcher: Launcher | None = None
    if provider_cmd:
        try:
            launcher = Launcher(provider_cmd, workdir, params.start_timeout, params.transport)
        except LaunchError as exc:
            for lane in lanes:
                emit(_lane_failed(lane, str(exc)))
            return results
    fault_env = {ENV_ENABLE: "1", ENV_TIMEOUT: f"{params.fault_timeout:g}"}
    down = unreachable(target, params) if target and {"core", "scale"} & set(lanes) else ""
    for lane in lanes:
        if lane not in LANES:
            raise ValueError(f"unknown lane {lane!r} (lanes: {', '.join(LANES)})")
        if lane == "core":
            if down:
                emit(_lane_failed("core", down))
            elif target:
                run("core", target)
            elif launcher:
                _with_launched(launcher, "core", params.core_seed, None, {}, lambda t: run("core", t), emit)
            else:
                emit(_lane_skipped("core", "no --target and no --provider-cmd"))
        elif lane == "fault":
            if not launcher:
                emit(_lane_skipped("fault", "needs --provider-cmd to start a provider with fault hooks"))
                continue
            _with_launched(launcher, "fault", 64, None, fault_env, lambda t: run("fault", t, {}), emit)
        elif lane == "durability":
            if not launcher:
                emit(_lane_skipped("durability", "needs --provider-cmd to kill and restart the provider"))
                continue
            if not launcher.has_state:
                emit(_lane_skipped("durability", "--provider-cmd has no {state_file} placeholder"))
                continue
            emit_durability(launcher, workdir, params, run, emit)
        elif lane == "scale":
            if launcher:
                _with_launched(launcher, "scale", params.scale_machines + params.scale_burst, None, {},
                               lambda t: run("scale", t, {}), emit)
            elif down:
                emit(_lane_failed("scale", down))
            elif target:
                run("scale", target, {})
            else:
                emit(_lane_skipped("scale", "no --target and no --provider-cmd"))
    return results


_NO_ANSWER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
TARGET_WAIT = 10.0  # a --target is already running: a short wait covers a restart, not a typo'd port


def unreachable(target: str, params: Params) -> str:
    """Why ``target`` cannot be certified ("" when its List answers within ``TARGET_WAIT`` seconds,
    or ``params.start_timeout`` if shorter).

    Without this every check of the lane failed on its own with a multi-line gRPC dump, which hid
    the one fact that mattered: nothing answered at that address."""
    wait = min(TARGET_WAIT, params.start_timeout)
    h = Harness(target, call_timeout=2.0, transport=params.transport)
    deadline = time.monotonic() + wait
    try:
        while True:
            try:
                h.list(max_results=1, timeout=2.0)
                return ""
            except grpc.RpcError as exc:
                if exc.code() not in _NO_ANSWER:
                    return ""  # it answered (a refusal is the checks' business, and they name it)
                if time.monotonic() > deadline:
                    return (f"provider at {target} did not answer List within {wait:g}s: "
                            f"{exc.code().name}: {' '.join((exc.details() or '').split())}")
                time.sleep(0.2)
    finally:
        h.close()


def _with_launched(launcher: Launcher, lane: str, seed: int, state: Path | None, env: dict[str, str],
                   body: Callable[[str], None], emit: Callable[[list[Result]], None]) -> None:
    try:
        target = launcher.start(lane, seed, state, env)
    except LaunchError as exc:
        emit(_lane_failed(lane, str(exc)))
        return
    try:
        body(target)
    finally:
        launcher.stop()


def emit_durability(launcher: Launcher, workdir: Path, params: Params,
                    run: Callable[[str, str, dict[str, Any], set[str] | None], None],
                    emit: Callable[[list[Result]], None]) -> None:
    state = workdir / "durability" / "provider-state.json"
    env = {ENV_ENABLE: "1", ENV_TIMEOUT: "120"}  # long enough that the hung transition is in flight at the kill
    shared: dict[str, Any] = {}
    try:
        target = launcher.start("durability", 64, state, env)
    except LaunchError as exc:
        emit(_lane_failed("durability", str(exc)))
        return
    h = Harness(target, settle_timeout=params.settle_timeout, transport=params.transport)
    try:
        shared["before"] = durability_before(h)
    except Exception as exc:
        launcher.kill()
        emit(_lane_failed("durability", f"set-up before the kill failed: {exc}"))
        return
    finally:
        h.close()
    launcher.kill()  # SIGKILL: no chance to flush anything
    try:
        # A different seed count: a provider that re-seeds instead of reloading would show it.
        target = launcher.start("durability-restarted", 7, state, env)
    except LaunchError as exc:
        emit(_lane_failed("durability", f"restart on the same state failed: {exc}"))
        return
    try:
        run("durability", target, shared, {c.id for c in checks_for("durability")} - {GRACEFUL})
        h = Harness(target, settle_timeout=params.settle_timeout, transport=params.transport)
        try:
            shared["graceful_before"] = {m.id: m.SerializeToString(deterministic=True) for m in h.list().machines}
        finally:
            h.close()
    finally:
        launcher.stop()  # SIGTERM this time
    try:
        target = launcher.start("durability-graceful", 7, state, env)
    except LaunchError as exc:
        emit([Result("durability", GRACEFUL, "graceful restart", "fail", 0.0, str(exc))])
        return
    try:
        run("durability", target, shared, {GRACEFUL})
    finally:
        launcher.stop()


# ---- reporting ----------------------------------------------------------------------------------


def print_table(results: Sequence[Result], out: TextIO) -> None:
    w_title = min(78, max((len(r.title) for r in results), default=10))
    out.write(f"{'lane':<11} {'check':<6} {'result':<6} {'secs':>6}  {'title':<{w_title}}\n")
    out.write("-" * (35 + w_title) + "\n")
    for r in results:
        mark = {"pass": "PASS", "fail": "FAIL", "skip": "SKIP"}[r.status]
        out.write(f"{r.lane:<11} {r.id:<6} {mark:<6} {r.seconds:>6.2f}  {r.title[:w_title]}\n")
        if r.detail and r.status != "pass":
            out.write(f"{'':<32}↳ {r.detail[:400]}\n")
        elif r.detail:
            out.write(f"{'':<32}  {r.detail[:400]}\n")
    counts = {s: sum(1 for r in results if r.status == s) for s in ("pass", "fail", "skip")}
    out.write(f"\n{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped\n")


def write_junit(results: Sequence[Result], path: str | os.PathLike[str]) -> None:
    suites = ET.Element("testsuites", name="bigfleet-provider-conformance")
    for lane in dict.fromkeys(r.lane for r in results):
        rs = [r for r in results if r.lane == lane]
        suite = ET.SubElement(
            suites, "testsuite", name=lane, tests=str(len(rs)),
            failures=str(sum(r.status == "fail" for r in rs)), skipped=str(sum(r.status == "skip" for r in rs)),
            time=f"{sum(r.seconds for r in rs):.3f}",
        )
        for r in rs:
            case = ET.SubElement(suite, "testcase", classname=f"conformance.{lane}", name=f"{r.id} {r.title}",
                                 time=f"{r.seconds:.3f}")
            if r.status == "fail":
                ET.SubElement(case, "failure", message=r.detail[:500]).text = r.detail
            elif r.status == "skip":
                ET.SubElement(case, "skipped", message=r.detail[:500])
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)
