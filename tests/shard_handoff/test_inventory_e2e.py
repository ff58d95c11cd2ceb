"""A real tier-1 inventory transfer: shard B (shared ownership) has demand and no machines; shard A
(exclusive, the provider's pool) has free ones. The coordinator's rebalancer moves machines from A
to B; B serves its cluster on them and A never touches them again."""

from __future__ import annotations

from pathlib import Path

import pytest
from shard.cluster import ShardProc, print_shard_logs, start_provider, stop_shards
from shard.opsim import FakeOperator, need
from shard.spy import spy_provider, until

from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.shard.handoff import OWNER_KEY
from bigfleet.v1alpha1 import coordinator_pb2 as pb
from bigfleet.v1alpha1 import provider_pb2

pytestmark = pytest.mark.slow

A, B = "shard-a", "shard-b"
MUTATING = ("Create", "Configure", "Drain", "Delete")
CONFIGURED = provider_pb2.MachineState.MACHINE_STATE_CONFIGURED


def shard_args(sid: str, coord: list[str], *extra: str) -> tuple[str, ...]:
    return ("--shard-id", sid, "--coordinator", ",".join(coord), "--heartbeat-interval", "0.3", *extra)


async def test_idle_machines_move_to_the_shard_with_a_shortfall(tmp_path: Path) -> None:
    g = CoordGroup(tmp_path / "coord", 1, extra=("--rebalance-interval", "0.5", "--transfer-cooldown", "1"))
    g.start_all()
    prov, paddr = start_provider("--seed-count", "8")
    a = b = None
    try:
        async with spy_provider(paddr) as (spy, spy_addr):
            a = await ShardProc(spy_addr, extra=shard_args(A, g.addresses)).start()
            b = await ShardProc(spy_addr, extra=shard_args(B, g.addresses, "--ownership", "shared")).start()
            assert sum((await b.counts()).by_state.values()) == 0
            total_a = sum((await a.counts()).by_state.values())
            assert total_a == 8

            async with FakeOperator(b.addr, "needy") as op:
                await op.send_rollup([need("4", count=2)])

                def transfers() -> list[pb.TransferStatus]:
                    return list(g.call(0, "ListTransfers", pb.ListTransfersRequest()).transfers)  # type: ignore[attr-defined]

                done = await until(lambda: [t for t in transfers() if t.kind == "inventory" and t.phase == "done"],
                                   90, "an inventory transfer A -> B done")
                t = done[0]
                assert (t.from_shard_id, t.to_shard_id) == (A, B) and t.machine_ids

                async def served() -> bool:
                    ms = [m for m in await spy.list_machines() if m.cluster == "needy"]
                    return bool(ms) and all(m.state == CONFIGURED for m in ms)

                await until(served, 60, "B's cluster Configured on transferred machines")
                needy = {m.id for m in await spy.list_machines() if m.cluster == "needy"}
                assert {m.shard_metadata.get(OWNER_KEY) for m in await spy.list_machines() if m.cluster} == {B}
                moved = {mid for tr in transfers() if tr.kind == "inventory" and tr.phase == "done"
                         for mid in tr.machine_ids}
                assert needy <= moved
                await a.wait_cycles(3)
                cnt_a = await a.counts()
                assert sum(cnt_a.by_state.values()) == total_a - len(moved)

            by_machine: dict[str, set[str]] = {}
            for name in MUTATING:
                for req in spy.of(name):
                    by_machine.setdefault(req.machine_id, set()).add(req.shard_id)
            assert all(len(s) == 1 for s in by_machine.values()), by_machine
            assert all(by_machine[mid] == {B} for mid in needy)
    except BaseException:
        print_shard_logs({"A": a, "B": b}, g.logs())
        raise
    finally:
        stop_shards(a, b)
        prov.stop()
        g.stop_all()
