"""End to end with real processes (fake provider + shard, the test as the operator): NeedVerdicts frames
on the wire (worker-mode rows), sent only on change and again to a new session; registration-timeout
reports fail only the reporting cluster's Configured machine, which is then replaced; a held roll-up's
ack carries rollup_held."""

from __future__ import annotations

import asyncio

import pytest

from bigfleet.v1alpha1 import provider_pb2, shard_pb2, shardread_pb2
from bigfleet.wire.needs import profile_from_proto

from .cluster import fleet
from .opsim import FakeOperator, need
from .spy import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

S = provider_pb2.MachineState


def latest(op: FakeOperator) -> dict[str, shard_pb2.NeedVerdict]:
    frames = op.of("need_verdicts")
    return {v.fingerprint: v for v in frames[-1].need_verdicts.verdicts} if frames else {}


async def test_need_verdicts_on_the_wire_and_registration_timeouts() -> None:
    async with fleet(("--seed-count", "4", "--create-delay", "0.2", "--configure-delay", "0.2")) as (_p, spy, shard):
        ok, bad = need("1"), need("2", zone="nowhere-1z")
        fp_ok, fp_bad = profile_from_proto(ok).fingerprint(), profile_from_proto(bad).fingerprint()
        async with FakeOperator(shard.addr, "c1") as op:
            await op.send_rollup([ok, bad])
            await until(lambda: latest(op).get(fp_ok) is not None and latest(op)[fp_ok].machines_bound == 1
                        and fp_bad in latest(op), 40, "verdicts: ok bound, bad decided")
            v = latest(op)[fp_bad]
            assert not v.satisfied and v.unmet_reason == shardread_pb2.UNMET_REASON_NO_MATCHING_SUPPLY
            assert v.machines_missing >= 1 and dict(v.deficit.resources) == {"cpu": "2"}
            f = op.of("need_verdicts")[-1].need_verdicts
            assert f.supersedes_key == "verdicts:c1" and f.cluster_id == "c1" and f.cycle > 0
            assert latest(op)[fp_ok].satisfied and latest(op)[fp_ok].machines_coming == 0
            # Escalation past 5 cycles arrives by itself (the rows do not change meanwhile).
            await until(lambda: latest(op)[fp_bad].escalated, 30, "escalated")
            v = latest(op)[fp_bad]
            assert v.shortfall_age_cycles > 5 and v.shortfall_age_seconds >= 1
            # Nothing changes now: no new frame over many cycles (ages alone are refreshed once a minute).
            n = len(op.of("need_verdicts"))
            await shard.wait_cycles(8)
            assert len(op.of("need_verdicts")) == n
            # A mid-stream Hello is answered as the first was: the verdicts come again.
            await op.send(shard_pb2.OperatorMessage(hello=shard_pb2.Hello(cluster_id="c1")))
            await until(lambda: len(op.of("need_verdicts")) > n, 10, "verdicts after a mid-stream Hello")
            assert set(latest(op)) == {fp_ok, fp_bad}
            machine = next(u for u in op.node_updates() if u.state == S.MACHINE_STATE_CONFIGURED)

            # A new session gets the current verdicts at once.
            async with FakeOperator(shard.addr, "c1") as op2:
                await until(lambda: op2.of("need_verdicts"), 10, "verdicts on a new session")
                assert set(latest(op2)) == {fp_ok, fp_bad}
                # Another cluster cannot fail c1's machine.
                async with FakeOperator(shard.addr, "c2") as other:
                    await other.send(shard_pb2.OperatorMessage(registration_timeout=shard_pb2.NodeRegistrationTimeout(
                        machine_id=machine.machine_id, node_name=machine.node_name, waited_seconds=900)))
                    await shard.wait_cycles(3)
                    c = await shard.counts("c1")
                    assert c.by_state.get("MACHINE_STATE_FAILED", 0) == 0
                # c1's report fails it; a replacement is configured and the need is met again.
                await op2.send(shard_pb2.OperatorMessage(registration_timeout=shard_pb2.NodeRegistrationTimeout(
                    machine_id=machine.machine_id, node_name=machine.node_name, waited_seconds=900)))
                failed = await until(lambda: [u for u in op2.node_updates(machine.machine_id)
                                              if u.state == S.MACHINE_STATE_FAILED], 20, "FAILED update")
                assert failed[0].last_error == (f"RegistrationTimeout: node {machine.node_name} did not register "
                                                f"within 900s")
                await until(lambda: any(u.state == S.MACHINE_STATE_CONFIGURED and u.machine_id != machine.machine_id
                                        for u in op2.node_updates()), 40, "a replacement Configured")
                await until(lambda: latest(op2)[fp_ok].satisfied and latest(op2)[fp_ok].machines_bound == 1, 20,
                            "ok met by the replacement")
                c = await shard.counts("c1")
                assert c.by_state.get("MACHINE_STATE_FAILED") == 1
                # Handed back to the provider: c1 was told, then Drain and Delete (the slot is free again).
                await until(lambda: spy.per_machine("Delete").get(machine.machine_id) == 1, 40, "handed back")
                assert spy.per_machine("Drain").get(machine.machine_id) == 1
                assert any(machine.node_name in r.nodes or machine.machine_id in r.nodes for r in op2.reclaims())
                # The report is idempotent.
                await op2.send(shard_pb2.OperatorMessage(registration_timeout=shard_pb2.NodeRegistrationTimeout(
                    machine_id=machine.machine_id, node_name=machine.node_name, waited_seconds=900)))
                await asyncio.sleep(1)
                assert (await shard.counts("c1")).by_state.get("MACHINE_STATE_FAILED") == 1
                # A collapse of the demand is held by the guard, and the ack says so (the operator's RollupHeld).
                acks = len(op2.acks("rollup"))
                await op2.send_rollup([])
                await until(lambda: len(op2.acks("rollup")) > acks, 10, "the roll-up's ack")
                assert op2.acks("rollup")[-1].rollup_held
                await op2.send_rollup([ok, bad])
                await until(lambda: len(op2.acks("rollup")) > acks + 1, 10, "the next ack")
                assert not op2.acks("rollup")[-1].rollup_held
