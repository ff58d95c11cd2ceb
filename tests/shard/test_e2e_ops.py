"""Operations around the hot path, with real processes: the kill switch and ShardAdmin, metrics,
AvailableCapacity hints, and the coordinator heartbeat."""

from __future__ import annotations

import tempfile
import urllib.request
from pathlib import Path

import grpc
import pytest

from bigfleet.rpc import insecure_channel
from bigfleet.security.tls import dial
from bigfleet.testing import ManagedProcess, free_port
from bigfleet.v1alpha1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    provider_pb2,
    shard_pb2,
    shardread_pb2,
    shardread_pb2_grpc,
)

from .cluster import ShardProc, fleet, start_provider
from .opsim import FakeOperator, need
from .spy import spy_provider, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

Conf = shard_pb2.AvailableCapacityUpdate


def _metric(text: str, name: str, labels: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + ("{" if labels else "")) and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_paused_shard_acts_on_nothing_until_resumed() -> None:
    mport = free_port()
    shard_args = ("--paused", "--metrics-listen", f"127.0.0.1:{mport}")
    async with fleet(("--seed-count", "2", "--committed-count", "2"), shard_args) as (_p, spy, shard):  # noqa: SIM117
        async with FakeOperator(shard.addr, "c1") as op:
            await op.send_rollup([need("7", count=1)])
            await until(lambda: op.acks("rollup"), 10, "roll-up ack")
            await shard.wait_cycles(4)
            assert not [n for n, _ in spy.calls if n in ("Create", "Configure", "Drain", "Delete")]
            assert not op.of("bootstrap_request")
            text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
            assert _metric(text, "bigfleet_shard_actions_suppressed_total", 'kind="Configure"') >= 1
            assert _metric(text, "bigfleet_shard_actuation_paused") == 1
            assert _metric(text, "bigfleet_shard_active_sessions") == 1
            assert "bigfleet_shard_cycle_phase_duration_seconds_bucket" in text
            assert _metric(text, "bigfleet_shard_inventory_machines", 'state="idle"') == 2

            # The hint for the demanded profile: HIGH (matching Idle exists), keyed by its fingerprint.
            frames = await shard.inspect("c1")
            fp = frames[1].need.profile_fingerprint
            await until(lambda: op.of("available_capacity"), 10, "AvailableCapacity hint")
            hint = op.of("available_capacity")[-1].available_capacity
            assert hint.supersedes_key == f"available:{fp}"
            assert hint.confidence == Conf.CONFIDENCE_HIGH and hint.available_count == 4
            assert len(op.of("available_capacity")) == 1  # unchanged → not re-sent

            async with insecure_channel(shard.addr) as ch:
                admin = shardread_pb2_grpc.ShardAdminStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as ei:  # the reason is for the log: bounded
                    await admin.SetActuation(shardread_pb2.SetActuationRequest(paused=False, reason="r" * 5000), timeout=5)
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert (await admin.GetActuation(shardread_pb2.GetActuationRequest(), timeout=5)).paused
                st = await admin.SetActuation(
                    shardread_pb2.SetActuationRequest(paused=False, reason="resume-for-e2e-test"), timeout=5)
                assert not st.paused
            await until(lambda: "resume-for-e2e-test" in shard.logs(), 10, "the reason in the shard's log")
            await until(lambda: _configured(shard, "c1", 1), 30, "configured after resume")
            assert len(spy.of("Configure")) == 1
            text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
            assert _metric(text, "bigfleet_shard_action_execute_outcomes_total", 'outcome="success"') >= 1
            assert _metric(text, "bigfleet_shard_provider_rpc_duration_seconds_count", 'rpc="Configure"') >= 1


async def _configured(shard: ShardProc, cluster: str, n: int) -> bool:
    return (await shard.counts(cluster)).by_state.get("MACHINE_STATE_CONFIGURED", 0) == n


async def test_shard_reports_to_the_coordinator() -> None:
    root = tempfile.mkdtemp(prefix="bigfleet-coord-")
    caddr = f"127.0.0.1:{free_port()}"
    coord = ManagedProcess.bigfleet(
        ["coordinator", "--node-id", "node-0", "--listen", caddr, "--raft-bind", f"127.0.0.1:{free_port()}",
         "--data-dir", root, "--log-format", "console"],
        "coordinator", env={"BIGFLEET_RAFT_PASSWORD": "shard-test-password"},
    ).start()
    try:
        async def listed() -> coordinator_pb2.ShardReportSnapshot | None:
            async with insecure_channel(caddr) as ch:
                stub = coordinator_pb2_grpc.CoordinatorStub(ch)
                shards = await stub.ListShards(coordinator_pb2.ListShardsRequest(), timeout=2)
                if not any(s.shard_id == "s1" and s.address for s in shards.shards):
                    return None
                reps = await stub.ListShardReports(coordinator_pb2.ListShardReportsRequest(shard_id="s1"), timeout=2)
                return next((r for r in reps.reports if r.summary.total_machines == 5), None)

        prov, paddr = start_provider("--seed-count", "3", "--committed-count", "2")
        shard = ShardProc(paddr, extra=("--coordinator", caddr, "--heartbeat-interval", "0.3"))
        try:
            await shard.start()
            rep = await until(listed, 60, "shard registered with a summary at the coordinator")
            assert rep.summary.free_machines == 5
            assert rep.summary.provider_address == paddr
        finally:
            if shard.proc:
                shard.proc.stop()
            prov.stop()
    except BaseException:
        print("---- coordinator log ----\n" + coord.logs()[-4000:])
        raise
    finally:
        coord.stop()


async def test_mtls_session_identity_and_read_gating(tmp_path: Path) -> None:
    from bigfleet.security.certs import make_local_pki
    from bigfleet.security.tls import TLSConfig

    make_local_pki(tmp_path, clusters=("c1", "c2"), shards=("s1",))

    def cfg(stem: str) -> TLSConfig:
        return TLSConfig.from_paths(tmp_path / f"{stem}.crt", tmp_path / f"{stem}.key", tmp_path / "ca.crt")

    shard_tls = ("--tls-cert", str(tmp_path / "shard-s1.crt"), "--tls-key", str(tmp_path / "shard-s1.key"),
                 "--tls-ca", str(tmp_path / "ca.crt"))
    prov, paddr = start_provider("--seed-count", "0", "--committed-count", "1")
    try:
        async with spy_provider(paddr, cfg("admin")) as (spy, spy_addr):
            shard = ShardProc(spy_addr, extra=shard_tls)
            shard.tls = cfg("admin")
            await shard.start()
            try:
                # the shard dialled the provider over mTLS and reconciled
                await until(lambda: _reconciled(shard), 30, "reconcile over mTLS")
                async with FakeOperator(shard.addr, "c1", tls=cfg("cluster-c1")) as op:
                    await until(lambda: op.acks("hello"), 10, "hello ack over mTLS")
                    await op.send_rollup([need("7")])
                    await until(lambda: _configured(shard, "c1", 1), 30, "configured over mTLS")
                    assert spy.of("Configure")[0].bootstrap_blob == op.blob
                # a certificate for c2 cannot open c1's session
                async with FakeOperator(shard.addr, "c1", tls=cfg("cluster-c2")) as impostor:
                    await until(lambda: impostor.status is not None, 10, "impostor rejected")
                    assert impostor.status == grpc.StatusCode.PERMISSION_DENIED
                # an operator certificate may not read the shard's inspection service
                async with dial(shard.addr, cfg("cluster-c1")) as ch:
                    with pytest.raises(grpc.aio.AioRpcError) as ei:
                        await shardread_pb2_grpc.ShardReadStub(ch).GetInventoryCounts(
                            shardread_pb2.InventoryCountsRequest(), timeout=5)
                    assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
            finally:
                if shard.proc:
                    shard.proc.stop()
    finally:
        prov.stop()


async def _reconciled(shard: ShardProc) -> bool:
    return bool((await shard.counts()).reconciled)


async def test_bootstrap_error_leaves_machine_idle_and_is_reported() -> None:
    async with fleet(("--seed-count", "0", "--committed-count", "1")) as (_p, spy, shard):
        op = FakeOperator(shard.addr, "c1", bootstrap_error="kubelet 1.20 outside the skew window")
        async with op:
            await op.send_rollup([need("7")])
            await until(lambda: len(op.of("bootstrap_request")) >= 2, 30, "bootstrap pulled (and retried)")
            frames = await until(lambda: _inspect_with_error(shard), 20, "bootstrap error in InspectNeeds")
            assert "skew window" in frames[1].need.bootstrap_error
            assert not spy.of("Configure")  # the provider is never touched without a blob
            # at the provider the machine is still Idle and unbound (between pulls the shard shows
            # it CONFIGURING for c1: it is being bound)
            records = await spy.list_machines()
            assert [(m.state, m.cluster) for m in records] == [(provider_pb2.MACHINE_STATE_IDLE, "")]
            # the operator recovers: the next pull succeeds and the machine is configured
            op.bootstrap_error = ""
            await until(lambda: _configured(shard, "c1", 1), 30, "configured once the operator can bootstrap")
            frames = await shard.inspect("c1")
            assert frames[1].need.bootstrap_error == ""


async def _inspect_with_error(shard: ShardProc) -> list[shardread_pb2.InspectNeedsResponse] | None:
    frames = await shard.inspect("c1")
    return frames if len(frames) > 1 and frames[1].need.bootstrap_error else None
