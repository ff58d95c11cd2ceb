"""The conformance suite: every lane passes against our providers, and it catches broken ones."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from bigfleet.process import free_port
from bigfleet.provider.conformance.runner import LANES, Params, run_suite
from bigfleet.provider.fake.backend import SimulatedCloud
from bigfleet.provider.fake.catalog import build_catalog
from bigfleet.provider.kit import Fence, KitError, serve
from bigfleet.provider.kit.core import ProviderCore
from bigfleet.provider.kit.model import State
from bigfleet.provider.kit.server import RunningProvider

ROOT = Path(__file__).resolve().parents[2]
FAKE_CMD = (f"{sys.executable} -m bigfleet.cli.main fake-provider --listen {{listen}} --state-file {{state_file}} "
            "--seed-count {seed_count} --log-level warning")
EXAMPLE_CMD = (f"{sys.executable} {ROOT / 'examples/provider/example_provider.py'} --listen {{listen}} "
               "--state-file {state_file} --seed-count {seed_count} --log-level warning")
SMALL = Params(scale_machines=1500, scale_burst=96, list_budget=10.0, rpc_budget=1.0, settle_timeout=30.0,
               core_seed=200)


def _summary(results: list[Any]) -> str:
    return "\n".join(f"{r.lane} {r.id} {r.status}: {r.detail}" for r in results if r.status != "pass")


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [FAKE_CMD, EXAMPLE_CMD], ids=["fake-provider", "example-provider"])
def test_every_lane_passes(cmd: str, tmp_path: Path) -> None:
    results = run_suite(None, LANES, cmd, SMALL, tmp_path)
    assert {r.lane for r in results} == set(LANES)
    assert all(r.status == "pass" for r in results), _summary(results)


@pytest.mark.slow
def test_cli_table_junit_and_exit_codes(fake_provider: str, tmp_path: Path) -> None:
    junit = tmp_path / "out.xml"
    cmd = [sys.executable, "-m", "bigfleet.cli.main", "conformance", "--target", fake_provider, "--quiet",
           "--lanes", "core,fault", "--only", "C101,C201,C504,F601", "--junit", str(junit)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "C201" in p.stdout and "3 passed, 0 failed, 1 skipped" in p.stdout
    suites = ET.parse(junit).getroot()
    cases = suites.findall(".//testcase")
    assert len(cases) == 4 and len(suites.findall(".//skipped")) == 1
    p = subprocess.run([*cmd[:-2], "--strict"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1  # the skipped fault lane fails a strict run
    p = subprocess.run([sys.executable, "-m", "bigfleet.cli.main", "conformance", "--lanes", "nope",
                        "--target", fake_provider], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2


# ---- the suite must fail broken providers ----------------------------------------------------------


@pytest.fixture
def in_process() -> Iterator[Callable[[Callable[[RunningProvider], None]], str]]:
    """Host a kit provider on a background event loop; the test may break it first."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    running: list[RunningProvider] = []

    def start(breaker: Callable[[RunningProvider], None]) -> str:
        rp = asyncio.run_coroutine_threadsafe(serve(SimulatedCloud(build_catalog(80))), loop).result(30)
        breaker(rp)
        running.append(rp)
        return f"127.0.0.1:{rp.port}"

    yield start
    for rp in running:
        asyncio.run_coroutine_threadsafe(rp.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def _no_fencing(rp: RunningProvider) -> None:
    core = rp.provider.core
    orig = core.mutate

    def mutate(kind: Any, mid: str, fence: Fence, *a: Any) -> Any:
        return orig(kind, mid, Fence(), *a)

    core.mutate = mutate  # type: ignore[method-assign]


def _fp_for_position(rp: RunningProvider) -> None:
    core = rp.provider.core
    orig = core.mutate

    def mutate(*a: Any) -> Any:
        try:
            return orig(*a)
        except KitError as exc:
            if exc.code == grpc.StatusCode.INTERNAL:
                raise KitError(grpc.StatusCode.FAILED_PRECONDITION, exc.message) from None
            raise

    core.mutate = mutate  # type: ignore[method-assign]


def _fixed_order(rp: RunningProvider) -> None:
    rp.provider.rng.randrange = lambda n: 0  # type: ignore[method-assign, assignment]


def _drops_metadata(rp: RunningProvider) -> None:
    core: ProviderCore = rp.provider.core
    orig = core.mutate

    def mutate(kind: Any, mid: str, fence: Fence, cluster: str = "", md: Any = None) -> Any:
        return orig(kind, mid, fence, cluster, {k: v for k, v in (md or {}).items() if "\x00" not in k + v})

    core.mutate = mutate  # type: ignore[method-assign]


def _no_revision_bump_on_completion(rp: RunningProvider) -> None:
    core = rp.provider.core
    orig = core.complete

    def complete(*a: Any, **kw: Any) -> bool:
        rev = core.rev
        ok = orig(*a, **kw)
        core.rev = rev
        return ok

    core.complete = complete  # type: ignore[method-assign]


def _list_hides(keep: Callable[[Any], bool]) -> Callable[[RunningProvider], None]:
    """List leaves out the machines ``keep`` rejects (Get still answers for them)."""

    def breaker(rp: RunningProvider) -> None:
        core = rp.provider.core
        orig = core.list

        def list_(*a: Any, **kw: Any) -> Any:
            records, rev = orig(*a, **kw)
            return [r for r in records if keep(r)], rev

        core.list = list_  # type: ignore[method-assign]

    return breaker


_hides_configured = _list_hides(lambda r: r.state != State.CONFIGURED)


def _truncates_at_50(rp: RunningProvider) -> None:
    """List answers one page of the substrate's listing and drops the rest (80 machines here)."""
    core = rp.provider.core
    orig = core.list

    def list_(*a: Any, **kw: Any) -> Any:
        records, rev = orig(*a, **kw)
        return records[:50], rev

    core.list = list_  # type: ignore[method-assign]


@pytest.mark.parametrize(
    "breaker, must_fail",
    [
        (_no_fencing, {"C201", "C202", "C204", "C207"}),
        (_fp_for_position, {"C104"}),
        (_fixed_order, {"C506"}),
        (_drops_metadata, {"C401"}),
        (_no_revision_bump_on_completion, {"C504"}),
        (_hides_configured, {"C507"}),
        (_truncates_at_50, {"C507"}),
    ],
    ids=["no-fencing", "fp-for-bad-transition", "fixed-list-order", "drops-metadata", "stale-revision",
         "list-hides-configured", "list-truncated"],
)
def test_suite_catches_broken_providers(in_process: Any, breaker: Any, must_fail: set[str], tmp_path: Path) -> None:
    target = in_process(breaker)
    results = run_suite(target, ["core"], None, Params(settle_timeout=5.0), tmp_path, only=must_fail | {"C101"})
    failed = {r.id for r in results if r.status == "fail"}
    assert must_fail <= failed, _summary(results)
    assert "C101" not in failed


def test_a_list_missing_machines_is_named_not_a_crash(in_process: Any, tmp_path: Path) -> None:
    """Checks that look a machine up in List say it is missing instead of failing with a Python error."""
    def breaker(rp: RunningProvider) -> None:
        _hides_configured(rp)
        hiding = rp.provider.core.list

        def list_(states: Any, max_results: int, *a: Any) -> Any:
            records, rev = hiding(states, max_results, *a)
            return ([] if max_results == 1 else records), rev

        rp.provider.core.list = list_  # type: ignore[method-assign]

    target = in_process(breaker)
    results = run_suite(target, ["core"], None, Params(settle_timeout=5.0), tmp_path,
                        only={"C401", "C503", "C506", "C507"})
    details = {r.id: r.detail for r in results}
    assert all(r.status == "fail" for r in results), _summary(results)
    assert not [d for d in details.values() if "unexpected error" in d], details
    assert "missing from List" in details["C401"] and "missing from List" in details["C507"], details
    assert "returned no machine" in details["C506"], details


def test_only_names_real_checks(in_process: Any) -> None:
    """A mistyped --only used to run nothing and exit 0 ("0 passed, 0 failed"): a false certificate."""
    target = in_process(lambda rp: None)
    base = [sys.executable, "-m", "bigfleet.cli.main", "conformance", "--target", target, "--quiet"]
    p = subprocess.run([*base, "--only", "C999,C101"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "C999" in p.stderr, p.stdout + p.stderr
    p = subprocess.run([*base, "--only", "F601"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "F601" in p.stderr and "fault" in p.stderr, p.stdout + p.stderr
    p = subprocess.run([*base, "--only", "c101"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "1 passed, 0 failed" in p.stdout, p.stdout + p.stderr


def test_an_unreachable_target_is_reported_once_per_check_in_one_line(tmp_path: Path) -> None:
    target = f"127.0.0.1:{free_port()}"
    results = run_suite(target, ["core", "scale"], None, Params(start_timeout=3.0), tmp_path)
    assert results and all(r.status == "fail" for r in results)
    assert {r.lane for r in results} == {"core", "scale"}
    for r in results:
        assert r.detail.startswith(f"provider at {target} did not answer List"), r.detail
        assert "UNAVAILABLE" in r.detail and "\n" not in r.detail and "unexpected error" not in r.detail


def test_launcher_reports_a_provider_that_does_not_start(tmp_path: Path) -> None:
    bad = f"{sys.executable} -c 'import sys; print(\"boom\"); sys.exit(3)' {{listen}}"
    results = run_suite(None, ["core", "fault"], bad, Params(start_timeout=20), tmp_path)
    assert results and all(r.status == "fail" for r in results)
    assert "exited with 3" in results[0].detail and "boom" in results[0].detail
    results = run_suite(None, ["durability"], f"{sys.executable} -c pass {{listen}}", Params(), tmp_path)
    assert all(r.status == "skip" and "state_file" in r.detail for r in results)
    results = run_suite(None, ["core"], f"{sys.executable} -c pass", Params(), tmp_path)
    assert all(r.status == "fail" and "{listen}" in r.detail for r in results)


# ---- ConfigureRequest.bootstrap_blob ≤ 1 MiB (docs/security.md) -------------------------------------


async def test_kit_refuses_a_bootstrap_blob_over_1_mib() -> None:
    """The kit answers INVALID_ARGUMENT above 1 MiB (it took 64 MiB) and changes nothing."""
    from bigfleet.provider.kit.core import MAX_BLOB_BYTES
    from bigfleet.rpc import insecure_channel
    from bigfleet.security.limits import DEFAULT_LIMITS
    from bigfleet.v1alpha1 import provider_pb2 as pb
    from bigfleet.v1alpha1 import provider_pb2_grpc as pbg

    assert MAX_BLOB_BYTES == DEFAULT_LIMITS.max_bootstrap_blob_bytes == 1 << 20
    running = await serve(SimulatedCloud(build_catalog(8)))
    try:
        async with insecure_channel(f"127.0.0.1:{running.port}") as ch:
            stub = pbg.CapacityProviderStub(ch)
            spec = (await stub.List(pb.ListFilter(states=[pb.MACHINE_STATE_SPECULATIVE]))).machines
            idle = [m.id for m in spec[:2]]
            for mid in idle:
                await stub.Create(pb.CreateRequest(machine_id=mid), timeout=10)
            for mid in idle:
                for _ in range(200):
                    if (await stub.Get(pb.MachineRef(id=mid))).state == pb.MACHINE_STATE_IDLE:
                        break
                    await asyncio.sleep(0.05)
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.Configure(pb.ConfigureRequest(machine_id=idle[0], cluster_id="c",
                                                         bootstrap_blob=b"x" * ((1 << 20) + 1)), timeout=10)
            assert ei.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "bootstrap_blob is 1048577 bytes, limit 1048576" in (ei.value.details() or "")
            assert (await stub.Get(pb.MachineRef(id=idle[0]))).state == pb.MACHINE_STATE_IDLE
            ack = await stub.Configure(pb.ConfigureRequest(machine_id=idle[1], cluster_id="c",
                                                           bootstrap_blob=b"x" * (1 << 20)), timeout=10)
            assert ack.operation_id and ack.machine.state == pb.MACHINE_STATE_CONFIGURING
    finally:
        await running.stop()


@pytest.mark.parametrize(("limit", "passes"), [(1 << 20, True), (64 << 20, True), (512 << 10, False)],
                         ids=["kit-1MiB", "lenient-64MiB", "too-strict-512KiB"])
def test_conformance_blob_check(in_process: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                limit: int, passes: bool) -> None:
    """C404: a provider must take the 1 MiB a shard may send; above that it may refuse (cleanly) or take it."""
    import bigfleet.provider.kit.core as kit_core

    monkeypatch.setattr(kit_core, "MAX_BLOB_BYTES", limit)
    target = in_process(lambda rp: None)
    results = run_suite(target, ["core"], None, Params(settle_timeout=5.0), tmp_path, only={"C402", "C404"})
    status = {r.id: r.status for r in results}
    assert status == {"C402": "pass", "C404": "pass" if passes else "fail"}, _summary(results)
