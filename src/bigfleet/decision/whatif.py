"""What-if: would candidate needs of one cluster be met now, and how? (ShardRead.WhatIf)

Pure: the engine is run on the caller's copy of the shard's inputs (demand, machines, carried state)
once without the candidates and once per candidate added to its cluster's demand; the answer is the
difference. Nothing here emits, replicates or mutates anything: the decisions are thrown away.

Each candidate is answered alone on top of today's demand (so its preemption victims and displaced
needs are its own), plus one run with every candidate at once for ``all_satisfiable``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from bigfleet.machine.record import Machine
from bigfleet.needs import EMPTY, Need, Resources
from bigfleet.needs.profile import merge_needs

from .engine import Engine
from .types import Decision, Drain, EngineConfig, EngineState, UnmetReason, Verdict

#: candidates per call: each costs one engine pass over the shard's state
MAX_WHATIF_NEEDS = 32
#: displaced needs listed per answer
MAX_DISPLACED = 20


class Outcome(enum.IntEnum):
    """Same numbers as shardread.proto `WhatIfOutcome`."""

    BOUND = 1
    IDLE = 2
    SPECULATIVE = 3
    PREEMPTION = 4
    UNSATISFIABLE = 5


@dataclass(frozen=True)
class Answer:
    """How one candidate would be served (counts are changes against the demand without it)."""

    index: int
    fingerprint: str
    outcome: Outcome
    bound: int = 0
    idle: int = 0
    speculative: int = 0
    victims: int = 0
    #: (priority, machines), highest priority first
    victim_priorities: tuple[tuple[int, int], ...] = ()
    unmet_reason: UnmetReason = UnmetReason.SATISFIED
    residual: Resources = EMPTY
    #: (cluster, fingerprint, priority) of needs met today that this one would leave unmet
    displaced: tuple[tuple[str, str, int], ...] = ()

    @property
    def satisfiable(self) -> bool:
        return self.outcome is not Outcome.UNSATISFIABLE

    def message(self) -> str:
        """One readable line (CLI table, CapacityRequest status)."""
        parts = [f"{n} {what}" for n, what in ((self.bound, "bound"), (self.idle, "idle"),
                                                (self.speculative, "speculative")) if n]
        if self.outcome is Outcome.UNSATISFIABLE:
            text = f"not satisfiable now ({self.unmet_reason.name.lower()})"
            if self.residual:
                text += ", missing " + ",".join(f"{k}={v}" for k, v in sorted(self.residual.to_wire().items()))
        elif self.outcome is Outcome.PREEMPTION:
            pr = ", ".join(f"{m} at priority {p}" for p, m in self.victim_priorities)
            text = f"by preempting {self.victims} machine(s) ({pr})"
        else:
            text = "now from " + (" + ".join(parts) or "bound machines")
        if self.displaced:
            text += f"; would leave {len(self.displaced)} need(s) met today unmet"
        return text


@dataclass(frozen=True)
class Result:
    answers: tuple[Answer, ...]
    all_satisfiable: bool


def what_if(needs: Sequence[Need], machines: Sequence[Machine], now_unix_nanos: int, state: EngineState,
            config: EngineConfig, cluster_id: str, candidates: Sequence[Need]) -> Result:
    """Answer each of ``candidates`` (all of ``cluster_id``) against ``needs`` and ``machines``.

    ``needs``/``machines``/``state`` are what the shard's next cycle would decide on; they are read,
    never changed. Raises ValueError for a candidate of another cluster or too many candidates.
    """
    if len(candidates) > MAX_WHATIF_NEEDS:
        raise ValueError(f"at most {MAX_WHATIF_NEEDS} needs per what-if")
    for c in candidates:
        if c.cluster_id != cluster_id:
            raise ValueError(f"candidate need of cluster {c.cluster_id!r}, asked for {cluster_id!r}")
    # Every action computed, none emitted; no truncation hides a victim.
    cfg = replace(config, paused=False, dry_run=True, max_actions_per_cycle=0)
    # One Engine for every pass: clusters other than the candidates' are reused from its cache
    # (its output is identical to a fresh `decide`).
    eng = Engine()
    base = eng.decide(needs, machines, now_unix_nanos, state, cfg)
    base_v = _verdicts(base)
    by_id = {m.id: m for m in machines}
    base_victims = _preempted(base)
    prio = {n.key: n.priority for n in needs}
    answers = []
    for i, cand in enumerate(candidates):
        added, st = _with(needs, (cand,), state, cfg)
        d = eng.decide(added, machines, now_unix_nanos, st, cfg)
        answers.append(_answer(i, cand, d, base_v, base_victims, by_id, prio))
    together = True
    if len(candidates) > 1:
        added, st = _with(needs, candidates, state, cfg)
        d = eng.decide(added, machines, now_unix_nanos, st, cfg)
        v = _verdicts(d)
        together = all(_met(v.get(c.key), _preempted(d) - base_victims) for c in candidates)
    elif answers:
        together = answers[0].satisfiable
    return Result(tuple(answers), together)


def _with(needs: Sequence[Need], cands: Sequence[Need], state: EngineState, cfg: EngineConfig
          ) -> tuple[list[Need], EngineState]:
    """The demand with the candidates folded in (a candidate with the profile of a need its cluster
    already has adds to that need, as a roll-up would), and carried state that lets a new candidate
    preempt this cycle (``preempt_after_cycles``): what-if answers whether preemption would serve it."""
    merged = merge_needs([*needs, *cands])
    ages = dict(state.unmet_ages)
    for c in cands:
        key = c.cluster_id + "\x00" + c.fingerprint
        ages[key] = max(ages.get(key, 0), cfg.preempt_after_cycles - 1)
    return merged, replace(state, unmet_ages=ages)


def _credited(v: Verdict) -> int:
    return v.claimed_count - v.bootstrap_count - v.provision_count


def _verdicts(d: Decision) -> dict[tuple[str, str], Verdict]:
    return {(v.cluster_id, v.fingerprint): v for v in d.verdicts}


def _preempted(d: Decision) -> set[str]:
    return {a.machine_id for a in (*d.actions, *d.suppressed) if isinstance(a, Drain) and a.reason == "preempt"}


def _met(v: Verdict | None, victims: set[str]) -> bool:
    """Met this cycle, or once the victims found for it have drained."""
    if v is None:
        return False
    if v.satisfied:
        return True
    return bool(victims) and v.capacity_freed is not None and v.capacity_freed.covers(v.deficit)


def _answer(i: int, cand: Need, d: Decision, base_v: Mapping[tuple[str, str], Verdict], base_victims: set[str],
            by_id: Mapping[str, Machine], prio: Mapping[tuple[str, str], int]) -> Answer:
    key = cand.key
    vs = _verdicts(d)
    v = vs.get(key)
    b = base_v.get(key)
    displaced = tuple(sorted(
        (k[0], k[1], prio.get(k, 0)) for k, was in base_v.items()
        if k != key and was.satisfied and (now := vs.get(k)) is not None and not now.satisfied))[:MAX_DISPLACED]
    if v is None:  # (every need gets a verdict; defensive)
        return Answer(i, cand.fingerprint, Outcome.UNSATISFIABLE, unmet_reason=UnmetReason.OTHER,
                      residual=cand.aggregate_resources, displaced=displaced)
    # (claimed_count counts this cycle's acquisitions too)
    bound = max(0, _credited(v) - (_credited(b) if b else 0))
    idle = max(0, v.bootstrap_count - (b.bootstrap_count if b else 0))
    spec = max(0, v.provision_count - (b.provision_count if b else 0))
    victims = sorted(_preempted(d) - base_victims)
    prios: dict[int, int] = {}
    hit: set[tuple[str, str, int]] = set()  # at whose expense: the needs whose machines would go
    for mid in victims:
        m = by_id.get(mid)
        if m is None:
            continue
        a = m.assignment
        # the stamp, or the need it serves if that is higher (what Phase 2 weighs)
        p = max(a.priority, prio.get((m.cluster, a.need_fingerprint), a.priority))
        prios[p] = prios.get(p, 0) + 1
        hit.add((m.cluster, a.need_fingerprint, p))
    vp = tuple(sorted(prios.items(), key=lambda t: -t[0]))
    displaced = tuple(sorted(set(displaced) | hit))[:MAX_DISPLACED]
    if v.satisfied:
        outcome = Outcome.SPECULATIVE if spec else Outcome.IDLE if idle else Outcome.BOUND
        return Answer(i, cand.fingerprint, outcome, bound, idle, spec, displaced=displaced)
    if _met(v, set(victims)):
        return Answer(i, cand.fingerprint, Outcome.PREEMPTION, bound, idle, spec, len(victims), vp,
                      displaced=displaced)
    reason = v.unmet_reason if v.unmet_reason is not UnmetReason.SATISFIED else UnmetReason.OTHER
    residual = v.deficit
    if v.capacity_freed is not None:
        residual = residual.saturating_sub(v.capacity_freed)
    return Answer(i, cand.fingerprint, Outcome.UNSATISFIABLE, bound, idle, spec, len(victims), vp, reason, residual,
                  displaced)
