"""Hand-backs after a node-registration timeout: recorded in the replicated state, retried, cleared
when done, and finished by the next leader (which would otherwise take the provider's "Configured"
as healthy supply)."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from bigfleet.shard.ha.node import LocalLog
from bigfleet.shard.ha.state import HAState, Retiring
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.retire import Retirer
from bigfleet.shard.view import MachineView
from bigfleet.v1alpha1 import provider_pb2

from .spy import until
from .test_verdicts_unit import machine

S = provider_pb2.MachineState
REASON = "RegistrationTimeout: node n1 did not register within 900s"


class Provider:
    """Drain makes a machine Idle, Delete makes it Speculative; every call is recorded."""

    def __init__(self) -> None:
        self.state: dict[str, int] = {}
        self.calls: list[tuple[str, str]] = []

    async def drain(self, machine_id: str, grace: int) -> None:
        self.calls.append(("Drain", machine_id))
        self.state[machine_id] = S.MACHINE_STATE_IDLE

    async def delete(self, machine_id: str) -> None:
        self.calls.append(("Delete", machine_id))
        self.state[machine_id] = S.MACHINE_STATE_SPECULATIVE

    async def get(self, machine_id: str) -> provider_pb2.Machine:
        return provider_pb2.Machine(id=machine_id, state=self.state.get(machine_id, S.MACHINE_STATE_CONFIGURED))  # type: ignore[arg-type]


class Operators:
    """tell_operator: refuses (no session) ``refusals`` times, then lets the drain go ahead."""

    def __init__(self, refusals: int = 0) -> None:
        self.refusals = refusals
        self.told: list[str] = []

    async def tell_operator(self, machine_id: str, cluster: str, node: str, grace: int, prio: int) -> str:
        self.told.append(machine_id)
        if self.refusals > 0:
            self.refusals -= 1
            return "no_session"
        return ""


class RecordingLog(LocalLog):
    def __init__(self, state: HAState) -> None:
        super().__init__(state)
        self.tracked: list[tuple[str, Retiring | None]] = []

    async def track_retiring(self, machine_id: str, entry: Retiring | None, epoch: int,
                             timeout: float = 10.0) -> bool:
        self.tracked.append((machine_id, entry))
        return await super().track_retiring(machine_id, entry, epoch, timeout)


def retirer(log: LocalLog, view: MachineView, provider: Provider, ops: Operators) -> Retirer:
    return Retirer(provider, ops, view, log, log.state.epoch, ShardMetrics(CollectorRegistry()),  # type: ignore[arg-type]
                   clock=asyncio.get_running_loop().time, wall_ns=lambda: 7, poll=0.01, retry=0.01)


async def test_a_hand_back_is_recorded_retried_and_cleared() -> None:
    log = RecordingLog(HAState(epoch=2))
    view = MachineView()
    view.set(machine("m1", S.MACHINE_STATE_CONFIGURED, "c1"))
    view.mark_failed("m1", REASON)
    provider, ops = Provider(), Operators(refusals=2)
    r = retirer(log, view, provider, ops)
    r.retire("m1", "c1", "n1", REASON)
    await until(lambda: ("Delete", "m1") in provider.calls and not log.state.retiring, 5, "deleted and cleared")
    assert log.tracked == [("m1", Retiring("c1", "n1", REASON, 7)), ("m1", None)]
    assert ops.told == ["m1"] * 3 and provider.calls == [("Drain", "m1"), ("Delete", "m1")]
    await r.stop()


async def test_the_next_leader_finishes_the_hand_back() -> None:
    """The leader that failed m1 died before handing it back: the provider still says Configured.
    The next leader fails it again (not supply) and hands it back; entries with nothing left to do
    (m2 was drained meanwhile, m3 is gone) are cleared."""
    state = HAState(epoch=3)
    state.retiring = {m: Retiring("c1", f"n-{m}", REASON, 1) for m in ("m1", "m2", "m3")}
    log = LocalLog(state)
    view = MachineView()
    view.set(machine("m1", S.MACHINE_STATE_CONFIGURED, "c1"))
    view.set(machine("m2", S.MACHINE_STATE_IDLE))
    provider, ops = Provider(), Operators()
    r = retirer(log, view, provider, ops)
    assert r.resume() == 1
    failed = view.get("m1")
    assert failed is not None and failed.state == S.MACHINE_STATE_FAILED and failed.last_error == REASON
    await until(lambda: not log.state.retiring, 5, "every entry cleared")
    assert provider.calls == [("Drain", "m1"), ("Delete", "m1")] and ops.told == ["m1"]
    await r.stop()


async def test_an_entry_from_a_stale_leader_is_refused() -> None:
    log = LocalLog(HAState(epoch=5))
    view = MachineView()
    view.set(machine("m1", S.MACHINE_STATE_CONFIGURED, "c1"))
    r = Retirer(Provider(), Operators(), view, log, 4, ShardMetrics(CollectorRegistry()),  # type: ignore[arg-type]
                clock=asyncio.get_running_loop().time, wall_ns=lambda: 7, poll=0.01, retry=0.01)
    r.retire("m1", "c1", "n1", REASON)
    await asyncio.sleep(0.2)
    assert log.state.retiring == {}
    await r.stop()
