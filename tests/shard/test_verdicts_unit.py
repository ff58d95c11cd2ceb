"""The shard's per-need verdict frames and registration-timeout handling, in-process: what a frame
says (bound / coming / missing, reason, ages, escalation), that unchanged verdicts are not re-sent,
and which registration-timeout reports fail a machine."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from bigfleet.decision.types import (
    Decision,
    EngineState,
    MatchingSupply,
    PhaseStats,
    UnmetReason,
    Verdict,
)
from bigfleet.needs import NeedsTable, Resources
from bigfleet.observability import new_registry
from bigfleet.shard.daemon import CycleRecord
from bigfleet.shard.engineproc import verdict_row
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.outbox import Outbox
from bigfleet.shard.sessions import SessionRegistry
from bigfleet.shard.verdicts import NeedVerdictSender, _CycleClock, machines_missing
from bigfleet.shard.view import MachineView
from bigfleet.v1alpha1 import provider_pb2, shard_pb2, shardread_pb2
from bigfleet.wire.machine import META_NEED_FINGERPRINT
from bigfleet.wire.needs import need_from_proto

from .opsim import need

S = provider_pb2.MachineState


class _Session:
    def __init__(self, cluster_id: str) -> None:
        self.cluster_id = cluster_id
        self.outbox = Outbox()
        self.frames: list[shard_pb2.ShardMessage] = []

    def send(self, msg: shard_pb2.ShardMessage) -> bool:
        self.frames.append(msg)
        return True


def _registry(*clusters: str) -> tuple[SessionRegistry, dict[str, _Session]]:
    reg = SessionRegistry()
    sessions = {c: _Session(c) for c in clusters}
    reg._by_cluster.update(sessions)  # type: ignore[arg-type]
    return reg, sessions


def machine(mid: str, state: int, cluster: str = "", fp: str = "") -> provider_pb2.Machine:
    pb = provider_pb2.Machine(id=mid, state=state, instance_type="m5.2xlarge", zone="z1",  # type: ignore[arg-type]
                              price_per_hour=0.1, cluster=cluster)
    pb.resources.resources.update({"cpu": "8", "memory": "32Gi"})
    pb.host.provider, pb.host.ref = "fake", f"host-{mid}"
    if fp:
        pb.shard_metadata[META_NEED_FINGERPRINT] = fp
    return pb


def verdict(cluster: str, fp: str, satisfied: bool, age: int = 0, deficit: dict[str, int] | None = None,
            reason: UnmetReason = UnmetReason.SATISFIED, claimed: int = 0, cycle: int = 0,
            configured: int = 0) -> Verdict:
    """A verdict as the decision of `cycle` gives it (unmet for `age` cycles; `configured` of the
    `claimed` machines Configured)."""
    return Verdict(cluster_id=cluster, fingerprint=fp, satisfied=satisfied,
                   deficit=Resources(deficit or {}), claimed_count=claimed, bootstrap_count=0, provision_count=0,
                   same_domain="", same_satisfiable=False, parked=False, parked_age_cycles=0,
                   unmet_since=-1 if satisfied else cycle - age, unmet_reason=reason, matching_supply=MatchingSupply(idle=0, configured=2),
                   claimed_configured=configured)


def record(cycle: int, verdicts: list[Verdict], rows: bool, wall_ns: int) -> CycleRecord:
    d = Decision(actions=(), shortfalls=(), verdicts=tuple(verdicts), stats=PhaseStats(),
                 state=EngineState(cycle=cycle))
    if rows:
        return CycleRecord(cycle, wall_ns, (), d, {(v.cluster_id, v.fingerprint): verdict_row(v, cycle)
                                                   for v in verdicts})
    return CycleRecord(cycle, wall_ns, (), d)


def sender(view: MachineView, table: NeedsTable, reg: SessionRegistry, **kw: Any) -> NeedVerdictSender:
    failed: list[int] = []
    s = NeedVerdictSender(reg, view, lambda: table, set(), {}, ShardMetrics(new_registry()), 5,
                          lambda *_: failed.append(1), lambda: 0.0, paced=False,
                          **{"actuating": lambda: True, **kw})
    return s


def test_machines_missing_uses_the_scarcest_dimension() -> None:
    unit = Resources.parse({"cpu": "8", "memory": "32Gi"})
    assert machines_missing(Resources.parse({"cpu": "20"}), unit) == 3
    assert machines_missing(Resources.parse({"cpu": "1", "memory": "70Gi"}), unit) == 3
    assert machines_missing(Resources.parse({"cpu": "1"}), unit) == 1
    # a dimension the unit lacks is ignored; never less than one
    assert machines_missing(Resources.parse({"nvidia.com/gpu": "4"}), unit) == 1


def test_cycle_clock_is_bounded_and_never_overstates() -> None:
    c = _CycleClock(cap=64)
    for k in range(1, 1001):
        c.add(k, k * 1_000_000_000)
    assert len(c.cycles) <= 65
    assert c.cycles[-1] == 1000
    for k in (1, 17, 500, 999, 1000):
        wall = c.wall_of(k)
        assert wall is not None and wall >= k * 1_000_000_000  # the first recorded cycle at or after k
    assert c.wall_of(5000) == 1000 * 1_000_000_000


@pytest.mark.parametrize("rows", [True, False], ids=["worker-rows", "inline-verdicts"])
def test_frame_content_dedupe_and_escalation(rows: bool) -> None:
    ok, bad = need("1"), need("4", zone="nowhere")
    nok, nbad = need_from_proto(ok, "c1", 1), need_from_proto(bad, "c1", 1)
    table = NeedsTable()
    table.replace("c1", [nok, nbad], 1)
    view = MachineView()
    view.set(machine("m1", S.MACHINE_STATE_CONFIGURED, "c1", nok.fingerprint))
    view.set(machine("m2", S.MACHINE_STATE_CONFIGURING, "c1", nok.fingerprint))
    view.set(machine("m3", S.MACHINE_STATE_CREATING, "", nok.fingerprint))
    view.reserved_for["m3"] = "c1"
    view.set(machine("m3", S.MACHINE_STATE_CREATING, "", nok.fingerprint), force=True)
    view.set(machine("m9", S.MACHINE_STATE_CONFIGURED, "c2", nok.fingerprint))  # another cluster's
    reg, sess = _registry("c1")
    s = sender(view, table, reg)
    miss = {"cpu": 20_000}
    configured = 1  # of the 3 machines the engine credits to `ok` (m1; m2 and m3 are on their way)

    def cycle(k: int, age: int) -> None:
        vs = [verdict("c1", nok.fingerprint, True, claimed=3, configured=configured),
              verdict("c1", nbad.fingerprint, False, age=age, deficit=miss, reason=UnmetReason.NO_MATCHING_SUPPLY,
                      cycle=k)]
        s.after_cycle(record(k, vs, rows, k * 1_000_000_000))

    cycle(10, 1)
    frames = sess["c1"].frames
    assert len(frames) == 1
    f = frames[0].need_verdicts
    assert f.supersedes_key == "verdicts:c1" and f.cluster_id == "c1" and f.cycle == 10
    by = {v.fingerprint: v for v in f.verdicts}
    v_ok, v_bad = by[nok.fingerprint], by[nbad.fingerprint]
    assert v_ok.satisfied and v_ok.machines_bound == 1 and v_ok.machines_coming == 2 and v_ok.machines_missing == 0
    assert not v_bad.satisfied and v_bad.unmet_reason == shardread_pb2.UNMET_REASON_NO_MATCHING_SUPPLY
    assert v_bad.machines_missing == 5  # 20 CPU missing in 4-CPU units (no machine serves it yet)
    assert v_bad.shortfall_age_cycles == 1 and not v_bad.escalated
    assert dict(v_bad.deficit.resources) == {"cpu": "20"}
    assert v_bad.matching_supply.configured == 2

    # Nothing changed but the age: no new frame (the row's "unmet since" is the same).
    cycle(11, 2)
    cycle(12, 3)
    assert len(frames) == 1
    # Age 6 > escalation age 5: a new frame says so, with the age in seconds since the first sighting.
    for k in (13, 14, 15):
        cycle(k, k - 9)
    assert len(frames) == 2
    v_bad = {v.fingerprint: v for v in frames[-1].need_verdicts.verdicts}[nbad.fingerprint]
    assert v_bad.escalated and v_bad.shortfall_age_cycles == 6 and v_bad.shortfall_age_seconds == 5
    # A machine finished configuring: the next cycle's counts changed, so the frame goes out.
    view.set(machine("m2", S.MACHINE_STATE_CONFIGURED, "c1", nok.fingerprint))
    configured = 2
    cycle(16, 7)
    assert len(frames) == 3
    v_ok = {v.fingerprint: v for v in frames[-1].need_verdicts.verdicts}[nok.fingerprint]
    assert (v_ok.machines_bound, v_ok.machines_coming) == (2, 1)
    # A new session gets the current verdicts at once.
    s.resync("c1")
    assert len(frames) == 4 and frames[-1].need_verdicts.verdicts == frames[-2].need_verdicts.verdicts


@pytest.mark.parametrize("rows", [False, True])
def test_a_need_met_only_by_machines_a_paused_shard_does_not_acquire_is_reported_unmet(rows: bool) -> None:
    """Paused (or dry-run), the engine still chooses machines for a need, but none is configured or
    created: the frame says so (not satisfied, actuation_paused, the chosen ones missing) and says
    satisfied again once actuation resumes; the switch alone brings every cluster into the next pass."""
    n = need_from_proto(need("1"), "c1", 1)
    table = NeedsTable()
    table.replace("c1", [n], 1)
    view = MachineView()
    view.set(machine("m1", S.MACHINE_STATE_CONFIGURED, "c1", n.fingerprint))
    reg, sess = _registry("c1")
    actuating = [False]
    s = sender(view, table, reg, actuating=lambda: actuating[0])
    v = dataclasses.replace(verdict("c1", n.fingerprint, True, claimed=3, configured=1), bootstrap_count=1,
                            provision_count=1)
    s.after_cycle(record(4, [v], rows, 4_000_000_000))
    (line,) = sess["c1"].frames[-1].need_verdicts.verdicts
    assert not line.satisfied and line.actuation_paused and line.machines_missing == 2
    assert line.unmet_reason == shardread_pb2.UNMET_REASON_UNSPECIFIED and not line.escalated
    assert (line.machines_bound, line.machines_coming) == (1, 0)
    for k in (5, 6, 7, 8, 9, 10, 11):  # held for longer than the escalation age: never escalated, no new frame
        s.after_cycle(record(k, [v], rows, k * 1_000_000_000))
    assert len(sess["c1"].frames) == 1
    actuating[0] = True
    s.actuation_changed()
    s.after_cycle(record(12, [v], rows, 12_000_000_000))
    (line,) = sess["c1"].frames[-1].need_verdicts.verdicts
    assert line.satisfied and not line.actuation_paused and len(sess["c1"].frames) == 2


def test_clusters_without_a_session_get_nothing() -> None:
    n = need_from_proto(need("1"), "c2", 1)
    table = NeedsTable()
    table.replace("c2", [n], 1)
    reg, sess = _registry("c1")
    s = sender(MachineView(), table, reg)
    s.after_cycle(record(1, [verdict("c2", n.fingerprint, True)], True, 1))
    assert sess["c1"].frames == [] or all(not f.need_verdicts.verdicts for f in sess["c1"].frames)


def test_registration_timeout_fails_only_the_reporting_clusters_configured_machine() -> None:
    view = MachineView()
    view.set(machine("m1", S.MACHINE_STATE_CONFIGURED, "c1", "fp"))
    view.set(machine("m2", S.MACHINE_STATE_CONFIGURED, "c2", "fp"))
    view.set(machine("m3", S.MACHINE_STATE_CONFIGURING, "c1", "fp"))
    view.set(machine("m4", S.MACHINE_STATE_CONFIGURED, "c1", "fp"))
    view.inflight["m4"] = "drain"
    reg, _ = _registry("c1")
    metrics = ShardMetrics(new_registry())
    triggered: list[tuple[str, ...]] = []
    s = NeedVerdictSender(reg, view, NeedsTable, set(), {}, metrics, 5, lambda *a: triggered.append(a),
                          lambda: 0.0, paced=False, actuating=lambda: True)

    def report(cluster: str, mid: str) -> str:
        return s.registration_timeout(cluster, shard_pb2.NodeRegistrationTimeout(
            machine_id=mid, node_name=f"node-{mid}", waited_seconds=900))

    assert report("c1", "nope") == "unknown"
    assert report("c1", "m2") == "not_bound"
    assert report("c1", "m3") == "not_configured"
    assert report("c1", "m4") == "in_flight"
    assert not triggered
    assert report("c1", "m1") == "failed"
    pb = view.get("m1")
    assert pb is not None and pb.state == S.MACHINE_STATE_FAILED
    assert pb.last_error == "RegistrationTimeout: node node-m1 did not register within 900s"
    assert "m1" in view.failed_local and triggered == [("m1", "c1", "node-m1")]  # (replace and hand back)
    # A provider record saying Configured does not bring it back; a repeated report is a no-op.
    view.observe(machine("m1", S.MACHINE_STATE_CONFIGURED, "c1", "fp"))
    assert view.get("m1").state == S.MACHINE_STATE_FAILED  # type: ignore[union-attr]
    assert report("c1", "m1") == "already_failed"
    c = metrics.registration_timeouts
    assert c.labels("failed")._value.get() == 1 and c.labels("already_failed")._value.get() == 1


def test_machine_changes_alone_bring_a_cluster_into_the_next_pass() -> None:
    """The counts are the engine's (what it credited to the need as of its cycle): a machine change
    brings the cluster into the next pass, and the frame moves with the next decision about it."""
    n = need_from_proto(need("1"), "c1", 1)
    table = NeedsTable()
    table.replace("c1", [n], 1)
    view = MachineView()
    view.set(machine("m1", S.MACHINE_STATE_CONFIGURING, "c1", n.fingerprint))
    reg, sess = _registry("c1")
    s = sender(view, table, reg)
    rec = record(5, [verdict("c1", n.fingerprint, True, claimed=1)], True, 5)
    s.after_cycle(rec)
    frames = sess["c1"].frames
    assert [(v.machines_bound, v.machines_coming) for v in frames[-1].need_verdicts.verdicts] == [(0, 1)]
    # Same verdict rows (the same objects: nothing re-decided), the machine finishes configuring.
    view.set(machine("m1", S.MACHINE_STATE_CONFIGURED, "c1", n.fingerprint))
    s.after_cycle(CycleRecord(6, 6, (), rec.decision, rec.verdict_rows))
    assert len(frames) == 1  # nobody said the cluster's machines changed
    s.machine_changed("c1")  # (the daemon's NodeStateUpdate routing does)
    s.after_cycle(CycleRecord(7, 7, (), rec.decision, rec.verdict_rows))
    assert len(frames) == 1  # looked at, but the engine has not credited it as Configured yet
    s.after_cycle(record(8, [verdict("c1", n.fingerprint, True, claimed=1, configured=1)], True, 8))
    assert len(frames) == 2
    assert [(v.machines_bound, v.machines_coming) for v in frames[-1].need_verdicts.verdicts] == [(1, 0)]


async def test_paced_frames_are_built_per_tick_from_the_newest_cycle() -> None:
    """The paced sender builds each frame when its turn comes (at most ``rate x TICK`` per tick,
    so a pass over many clusters never holds the loop at once) and from the newest record: a
    cluster queued by one cycle and sent after the next carries the next cycle's verdict."""
    import asyncio

    clusters = [f"c{k}" for k in range(200)]
    table = NeedsTable()
    fps = {}
    for c in clusters:
        n = need_from_proto(need("1"), c, 1)
        table.replace(c, [n], 1)
        fps[c] = n.fingerprint
    reg, sess = _registry(*clusters)
    s = NeedVerdictSender(reg, MachineView(), lambda: table, set(), {}, ShardMetrics(new_registry()), 5,
                          lambda *_: None, lambda: asyncio.get_running_loop().time(), paced=True,
                          actuating=lambda: True, interval=0.0, rate=1000.0)
    built: list[int] = []
    real = s._cluster_frame

    def counting(*a: Any, **kw: Any) -> Any:
        built.append(a[0].cycle)
        return real(*a, **kw)

    s._cluster_frame = counting  # type: ignore[method-assign]
    task = asyncio.create_task(s.run())
    try:
        s.after_cycle(record(1, [verdict(c, fps[c], True) for c in clusters], True, 1))
        await asyncio.sleep(0)  # the pass: clusters queued, nothing built yet
        assert len(built) <= int(s.rate * s.TICK)
        s.after_cycle(record(2, [verdict(c, fps[c], False, deficit={"cpu": 1000}) for c in clusters], True, 2))
        for _ in range(500):
            if all(f.need_verdicts.cycle == 2 for c in clusters for f in sess[c].frames[-1:]) \
                    and all(sess[c].frames for c in clusters):
                break
            await asyncio.sleep(s.TICK)
        per_tick = int(s.rate * s.TICK)
        assert built.count(1) <= per_tick  # only the first tick's frames came from cycle 1
        assert all(sess[c].frames[-1].need_verdicts.cycle == 2 for c in clusters)
        assert all(not sess[c].frames[-1].need_verdicts.verdicts[0].satisfied for c in clusters)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _reference_verdict(n: Any, row: tuple[Any, ...], cycle: int, bound: int, coming: int, unit: Resources | None,
                       err: str, escalation_after: int) -> shard_pb2.NeedVerdict:
    """A frame line built the way the sender did before it compared plain values: through the
    ShardRead NeedView (`_fill_from_row`), field by field."""
    from bigfleet.shard.readsvc import _fill_from_row

    view = shardread_pb2.NeedView()
    _fill_from_row(view, row, cycle)
    v = shard_pb2.NeedVerdict(fingerprint=n.fingerprint, satisfied=view.satisfied, unmet_reason=view.unmet_reason,
                              machines_bound=bound, machines_coming=coming)
    if not view.satisfied:
        v.shortfall_age_cycles = view.age_cycles_unmet
        v.escalated = view.age_cycles_unmet > escalation_after
        v.deficit.CopyFrom(view.residual_deficit)
        v.matching_supply.CopyFrom(view.matching_supply)
        v.machines_missing = machines_missing(Resources.parse(dict(view.residual_deficit.resources)),
                                              unit if unit else n.min_unit)
        v.victims_found = view.preemption.victims_found
    if err:
        v.bootstrap_error = err[:1024]
    return v


@pytest.mark.parametrize("seed", range(20))
def test_frame_lines_equal_the_need_view_built_ones(seed: int) -> None:
    """Property: over random verdicts (every reason, deficits, supply, victims, bootstrap errors), each
    frame line is the one the NeedView route builds, byte for byte (shortfall seconds aside: no clock)."""
    import random

    rnd = random.Random(seed)
    cycle = rnd.randint(1, 50)
    protos = [need(str(rnd.randint(1, 8)), priority=p, zone=rnd.choice([None, "z1", "z9"])) for p in range(6)]
    needs = [need_from_proto(pb, "c1", 1) for pb in protos]
    table = NeedsTable()
    table.replace("c1", needs, 1)
    view = MachineView()
    reg, sess = _registry("c1")
    failures: dict[tuple[str, str], str] = {}
    s = NeedVerdictSender(reg, view, lambda: table, set(), failures, ShardMetrics(new_registry()), 5,
                          lambda *_: None, lambda: 0.0, paced=False, actuating=lambda: True)
    verdicts, rows = [], {}
    for i, n in enumerate(needs):
        if rnd.random() < 0.5:
            view.set(machine(f"m{i}", rnd.choice([S.MACHINE_STATE_CONFIGURED, S.MACHINE_STATE_CONFIGURING]), "c1",
                             n.fingerprint))
        if rnd.random() < 0.3:
            failures[("c1", n.fingerprint)] = "boom " * rnd.randint(1, 300)
        ok = rnd.random() < 0.3
        reason = UnmetReason.SATISFIED if ok else rnd.choice(list(UnmetReason)[1:])
        v = Verdict(cluster_id="c1", fingerprint=n.fingerprint, satisfied=ok,
                    deficit=Resources({} if ok else {"cpu": rnd.randint(1, 90_000), "memory": rnd.randint(0, 2**36)}),
                    claimed_count=(claimed := rnd.randint(0, 3)), bootstrap_count=0, provision_count=0, same_domain="",
                    same_satisfiable=False, parked=False, parked_age_cycles=0,
                    unmet_since=-1 if ok else rnd.randint(0, cycle - 1), unmet_reason=reason,
                    matching_supply=MatchingSupply(idle=rnd.randint(0, 4), configured=rnd.randint(0, 4),
                                                   speculative=rnd.randint(0, 4), capped=rnd.random() < 0.5),
                    victims_found=rnd.randint(0, 9),
                    capacity_freed=Resources({"cpu": 1000}) if rnd.random() < 0.5 else None,
                    claimed_configured=rnd.randint(0, claimed))
        verdicts.append(v)
        rows[("c1", n.fingerprint)] = verdict_row(v, cycle)
    s.after_cycle(record(cycle, verdicts, rnd.random() < 0.5, cycle * 1_000_000_000))
    (frame,) = sess["c1"].frames
    units = {m.assignment.need_fingerprint: m.effective_allocatable for m in map(view.machine, view.ids()) if m}
    by_fp = {n.fingerprint: n for n in needs}
    by_v = {v.fingerprint: v for v in verdicts}
    assert len(frame.need_verdicts.verdicts) == len(needs)
    for got in frame.need_verdicts.verdicts:
        n = by_fp[got.fingerprint]
        v = by_v[n.fingerprint]
        bound, coming, unit = v.claimed_configured, v.claimed_count - v.claimed_configured, units.get(n.fingerprint)
        want = _reference_verdict(n, rows[("c1", n.fingerprint)], cycle, bound, coming, unit,
                                  failures.get(("c1", n.fingerprint), ""), 5)
        got.ClearField("shortfall_age_seconds")
        assert got == want
        assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)


def test_counts_follow_the_engines_credit_not_the_need_a_machine_was_made_for() -> None:
    """A cluster's needs share its machines in precedence order, so a machine made for one need often
    serves another. The frame counts what the engine credited to each need: here the higher-priority
    need `hi` keeps the Configured machine made for `lo`, and `lo` the Configuring one made for `hi`
    (counting by the need a machine was made for said `lo` was served by a Configured machine and `hi`
    by none: a satisfied request read "0 machine(s) serve this need" in the operator's cluster)."""
    from bigfleet.decision import EngineConfig, decide

    hi, lo = need_from_proto(need("1", priority=100), "c1", 1), need_from_proto(need("1", priority=50, zone="z1"), "c1", 1)
    table = NeedsTable()
    table.replace("c1", [hi, lo], 1)
    view = MachineView()
    view.set(machine("m1", S.MACHINE_STATE_CONFIGURED, "c1", lo.fingerprint))
    view.set(machine("m2", S.MACHINE_STATE_CONFIGURING, "c1", hi.fingerprint))
    d = decide(table, list(view.machines()), 10**18, EngineState(cycle=3), EngineConfig())
    by_fp = {v.fingerprint: v for v in d.verdicts}
    assert all(v.satisfied and v.claimed_count == 1 for v in d.verdicts) and not d.actions
    assert (by_fp[hi.fingerprint].claimed_configured, by_fp[lo.fingerprint].claimed_configured) == (1, 0)
    reg, sess = _registry("c1")
    s = sender(view, table, reg)
    s.after_cycle(CycleRecord(d.state.cycle, 1, (), d, {(v.cluster_id, v.fingerprint): verdict_row(v, d.state.cycle)
                                                       for v in d.verdicts}))
    lines = {v.fingerprint: (v.machines_bound, v.machines_coming) for v in sess["c1"].frames[-1].need_verdicts.verdicts}
    assert lines == {hi.fingerprint: (1, 0), lo.fingerprint: (0, 1)}
