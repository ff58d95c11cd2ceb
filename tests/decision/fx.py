"""Builders for decision-engine tests: the §17 GPU fixture and small helpers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from bigfleet.decision import (
    Action,
    Configure,
    Create,
    Decision,
    Delete,
    Drain,
    EngineConfig,
    EngineState,
    decide,
)
from bigfleet.machine import CapacityType, Inventory, Machine, MachineState
from bigfleet.needs import Need, Operator, PenaltyBucket, Profile, Requirement, Resources, TopologySpread

S = MachineState
GPU_TYPE = "a3-highgpu-8g"
ZONE_KEY = "topology.kubernetes.io/zone"
TYPE_KEY = "node.kubernetes.io/instance-type"
NOW = 1_000_000 * 1_000_000_000


def gpu(units: int = 1) -> Resources:
    return Resources.from_milli({"nvidia.com/gpu": 8000 * units})


def cpu(n: float, mem_gi: float = 0) -> Resources:
    d = {"cpu": int(n * 1000)}
    if mem_gi:
        d["memory"] = int(mem_gi * (1 << 30) * 1000)
    return Resources.from_milli(d)


def machine(mid: str, state: MachineState = S.IDLE, *, cluster: str = "", zone: str = "us-east-1a",
            itype: str = GPU_TYPE, ctype: CapacityType = CapacityType.BARE_METAL, price: float = 0.0,
            prob: float = 0.0, res: Resources | None = None, labels: dict[str, str] | None = None,
            prio: int = 0, ipd: float = 0.0, rpd: float = 0.0, fp: str = "", group: str = "",
            since: int = NOW) -> Machine:
    host = "" if state in (S.SPECULATIVE,) else "fake"
    return Machine(
        mid, state, instance_type=itype, zone=zone, capacity_type=ctype, price_per_hour=price,
        interruption_probability=prob, labels=labels or {}, resources=res if res is not None else gpu(1),
        cluster=cluster, host_provider=host, host_ref=mid if host else "",
        assigned_priority=prio, assigned_interruption_penalty_dollars=ipd,
        assigned_reclamation_penalty_dollars=rpd, assigned_need_fingerprint=fp, assigned_group=group,
        state_since_unix_nanos=since, last_error="boom" if state == S.FAILED else "",
    )


def profile(prio: int = 1_000_000, *, reqs: Sequence[Requirement] | None = None,
            ib: PenaltyBucket = PenaltyBucket.B8192, rb: PenaltyBucket = PenaltyBucket.ZERO,
            group: str = "", spread: Sequence[TopologySpread] = ()) -> Profile:
    if reqs is None:
        reqs = [Requirement(TYPE_KEY, Operator.IN, (GPU_TYPE,))]
    return Profile.build(reqs, spread, prio, ib, rb, group)


def need(cluster: str, units: int | Resources, prof: Profile | None = None, *,
         min_unit: Resources | None = None, arrival: int = 1) -> Need:
    agg = gpu(units) if isinstance(units, int) else units
    return Need(cluster, prof or profile(), agg, min_unit if min_unit is not None else gpu(1), arrival)


def same_zone(prio: int = 1_000_000, group: str = "g", **kw: object) -> Profile:
    reqs = [Requirement(TYPE_KEY, Operator.IN, (GPU_TYPE,)), Requirement(ZONE_KEY, Operator.SAME, ())]
    return profile(prio, reqs=reqs, group=group, **kw)  # type: ignore[arg-type]


def run(needs: Iterable[Need], machines: Iterable[Machine], *, state: EngineState | None = None,
        config: EngineConfig | None = None, now: int = NOW, ready: Iterable[str] = ()) -> Decision:
    st = state or EngineState()
    for c in ready:
        st = st.with_first_rollup(c)
    return decide(list(needs), Inventory(machines), now, st, config or EngineConfig())


def kinds(d: Decision) -> list[tuple[str, str]]:
    return [(a.kind, a.machine_id) for a in d.actions]


def of(d: Decision, t: type) -> list[Action]:
    return [a for a in d.actions if isinstance(a, t)]


def configures(d: Decision) -> list[Configure]:
    return [a for a in d.actions if isinstance(a, Configure)]


def creates(d: Decision) -> list[Create]:
    return [a for a in d.actions if isinstance(a, Create)]


def drains(d: Decision) -> list[Drain]:
    return [a for a in d.actions if isinstance(a, Drain)]


def deletes(d: Decision) -> list[Delete]:
    return [a for a in d.actions if isinstance(a, Delete)]


def unsat(d: Decision) -> list[tuple[str, Resources]]:
    return [(v.cluster_id, v.deficit) for v in d.verdicts if not v.satisfied]
