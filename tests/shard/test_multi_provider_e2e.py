"""One pool across two providers, with real processes: a fake provider offering only bare metal
(``--cloud onprem``), another offering only cloud quota (``--cloud aws``), one shard given both
(``--provider metal=... --provider cloud=...``), the test as the operator. Recording pass-throughs
in front of each provider show which provider every call went to."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from bigfleet.testing import ManagedProcess, wait_for_health

from .cluster import ShardProc, start_provider
from .opsim import FakeOperator, need
from .spy import spy_provider, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

CONFIGURED = "MACHINE_STATE_CONFIGURED"


async def test_bare_metal_first_both_configured_restarts_and_one_provider_down() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bigfleet-multi-"))
    metal, metal_addr = start_provider("--cloud", "onprem", "--committed-count", "2", "--seed-count", "0",
                                       "--state-file", str(tmp / "metal.json"), name="metal")
    cloud_args = ("--cloud", "aws", "--seed-count", "6", "--committed-count", "0", "--create-delay", "0.3",
                  "--state-file", str(tmp / "cloud.json"))
    cloud, cloud_addr = start_provider(*cloud_args, name="cloud")
    # Every reconcile's 3rd List is a full one: the provider-down phase exercises the "forget" path.
    cfg = tmp / "shard.yaml"
    cfg.write_text("full_reconcile_every: 3\n")
    shard: ShardProc | None = None
    try:
        async with spy_provider(metal_addr) as (mspy, mspy_addr), spy_provider(cloud_addr) as (cspy, cspy_addr):
            shard = await ShardProc(f"metal={mspy_addr}", extra=(
                "--provider", f"cloud={cspy_addr}", "--config", str(cfg), "--no-empty-rollup-guard",
                "--provider-start-grace", "1")).start()
            async with FakeOperator(shard.addr, "c1", blob=b"join-c1") as op:
                await op.send_rollup([need("7", count=3)])

                async def bound(n: int) -> bool:
                    c = await shard.counts()
                    return c.bound_by_cluster.get("c1", 0) == n and c.by_state.get(CONFIGURED, 0) == n
                await until(lambda: bound(3), 40, "3 machines Configured for c1")

                # Idle bare metal (price 0) is used before any cloud capacity: both metal hosts are
                # bound and only the remainder is created -- at the provider that offers it.
                assert not mspy.of("Create"), "nothing is created on the bare-metal provider"
                assert sorted(mspy.per_machine("Configure")) == ["onprem-00000", "onprem-00001"]
                assert len(cspy.per_machine("Create")) == 1 and len(cspy.per_machine("Configure")) == 1
                assert set(cspy.per_machine("Create")) == set(cspy.per_machine("Configure"))
                # Each provider saw its own ids, and fencing tokens with this shard's epoch.
                assert all(r.shard_id == "s1" and r.shard_epoch >= 1 for r in [*mspy.of("Configure"),
                                                                              *cspy.of("Create")])
                bound_ids = {m.id for m in [*await mspy.list_machines(), *await cspy.list_machines()]
                             if m.cluster == "c1"}
                assert len(bound_ids) == 3
                # The operator knows them under the shard's names: provider/<id>.
                await until(lambda: sum(1 for mid, st in op.latest_node_states().items()
                                        if st == 5 and mid.split("/")[0] in ("metal", "cloud")) == 3,
                            20, "CONFIGURED NodeStateUpdates for both providers' machines")

            # A restart (a new leadership term) reads both providers again and keeps both sets.
            creates, configures = len(cspy.of("Create")), len(mspy.of("Configure")) + len(cspy.of("Configure"))
            assert shard.proc is not None
            shard.proc.stop()
            await shard.start()
            await until(lambda: bound(3), 30, "both providers' machines still bound after a restart")
            await shard.wait_cycles(3)
            assert len(cspy.of("Create")) == creates
            assert len(mspy.of("Configure")) + len(cspy.of("Configure")) == configures
            assert not mspy.of("Drain") and not cspy.of("Drain")

            # The cloud provider goes down: full reconciles go on (the metal one's machines are read),
            # nothing of the cloud's is forgotten or quarantined, cycles continue.
            lists = len(mspy.of("List"))
            cloud.stop()
            await shard.wait_cycles(5)
            await until(lambda: _more(len(mspy.of("List")), lists + 6), 20, "metal Lists go on")
            c = await shard.counts()
            assert c.bound_by_cluster.get("c1", 0) == 3 and c.by_state.get(CONFIGURED, 0) == 3
            assert c.total == 2 + 6

            # A new term while it is down: after --provider-start-grace the shard decides on the metal
            # provider alone (its machines are read); the cloud's join when it answers.
            shard.proc.stop()
            await shard.start()
            await until(lambda: bound(2), 30, "the metal provider's machines read without the cloud one")

            # It comes back (same port, same state): nothing was lost on either side.
            cloud = ManagedProcess.bigfleet(["fake-provider", "--listen", cloud_addr, "--log-format", "console",
                                             *cloud_args], "cloud").start()
            wait_for_health(cloud_addr, timeout=60)
            lists_c = len(cspy.of("List"))
            await until(lambda: _more(len(cspy.of("List")), lists_c + 3), 30, "cloud Lists answered again")
            await until(lambda: bound(3), 10, "3 bound after the cloud provider returned")
            assert len(cspy.of("Create")) == creates
    except BaseException:
        if shard is not None:
            print("---- shard log ----\n" + shard.logs()[-6000:])
        raise
    finally:
        if shard is not None and shard.proc is not None:
            shard.proc.stop()
        metal.stop()
        cloud.stop()
        shutil.rmtree(tmp, ignore_errors=True)


async def _more(have: int, want: int) -> bool:
    return have >= want
