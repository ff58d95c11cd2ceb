"""What-if (decision/whatif.py): each candidate answered by source, victims by priority, displaced
needs, and the inputs left untouched."""

from __future__ import annotations

import copy

import pytest

from bigfleet.decision import EngineConfig, EngineState, UnmetReason
from bigfleet.decision.whatif import MAX_WHATIF_NEEDS, Outcome, what_if

from .fx import NOW, S, gpu, machine, need, profile

HI, LO = 1_000_000, 1_000


def ask(needs: list, machines: list, cands: list, state: EngineState | None = None):  # type: ignore[no-untyped-def]
    return what_if(needs, machines, NOW, state or EngineState(), EngineConfig(), "c1", cands)


def test_idle_then_speculative_then_bound() -> None:
    ms = [machine("i1"), machine("s1", S.SPECULATIVE), machine("s2", S.SPECULATIVE)]
    r = ask([], ms, [need("c1", 1, arrival=NOW), need("c1", 3, profile(HI - 1), arrival=NOW)])
    a, b = r.answers
    assert (a.outcome, a.idle, a.speculative) == (Outcome.IDLE, 1, 0)
    # alone, the second takes the idle machine and both speculative ones
    assert (b.outcome, b.idle, b.speculative) == (Outcome.SPECULATIVE, 1, 2)
    assert not r.all_satisfiable  # 4 wanted, 3 exist
    # an excess bound machine of the cluster serves a candidate before anything else
    bound = [machine("b1", S.CONFIGURED, cluster="c1", prio=HI, fp="x")]
    r = ask([], bound + ms, [need("c1", 1, arrival=NOW)])
    assert (r.answers[0].outcome, r.answers[0].bound) == (Outcome.BOUND, 1)
    assert r.all_satisfiable


def test_preemption_names_victims_by_priority() -> None:
    other = profile(LO)
    ms = [machine("v1", S.CONFIGURED, cluster="c2", prio=LO, fp=other.fingerprint()),
          machine("v2", S.CONFIGURED, cluster="c2", prio=LO + 1, fp=other.fingerprint())]
    today = [need("c2", 2, other)]
    r = ask(today, ms, [need("c1", 1, arrival=NOW)])
    a = r.answers[0]
    assert a.outcome is Outcome.PREEMPTION and a.victims == 1 and a.satisfiable
    assert a.victim_priorities == ((LO, 1),)  # the lower stamp goes first
    assert ("c2", other.fingerprint(), LO) in a.displaced
    assert "preempting 1" in a.message()


def test_unsatisfiable_with_reason_and_residual() -> None:
    r = ask([], [machine("i1")], [need("c1", 3, arrival=NOW)])
    a = r.answers[0]
    assert a.outcome is Outcome.UNSATISFIABLE and not r.all_satisfiable
    assert a.unmet_reason in (UnmetReason.PRIORITY_STARVED, UnmetReason.NO_MATCHING_SUPPLY)
    assert a.residual == gpu(2)
    # nothing matches at all
    r = ask([], [machine("i1", itype="other")], [need("c1", 1, arrival=NOW)])
    assert r.answers[0].unmet_reason is UnmetReason.NO_MATCHING_SUPPLY


def test_a_candidate_with_an_existing_profile_adds_to_that_need() -> None:
    ms = [machine("b1", S.CONFIGURED, cluster="c1", prio=HI, fp=profile().fingerprint()), machine("i1")]
    today = [need("c1", 1)]
    a = ask(today, ms, [need("c1", 1, arrival=NOW)]).answers[0]
    # the existing need keeps its bound machine; the extra unit is the idle one
    assert (a.outcome, a.bound, a.idle) == (Outcome.IDLE, 0, 1)


def test_inputs_are_not_changed_and_input_is_checked() -> None:
    ms = [machine("i1"), machine("v1", S.CONFIGURED, cluster="c2", prio=LO, fp="f")]
    today = [need("c2", 1, profile(LO))]
    state = EngineState(cycle=7, unmet_ages={"c2\x00x": 3})
    before = (copy.deepcopy(ms), list(today), state.to_dict())
    ask(today, ms, [need("c1", 2, arrival=NOW)], state)
    assert (ms, today, state.to_dict()) == before
    with pytest.raises(ValueError, match="cluster"):
        ask([], ms, [need("c9", 1)])
    with pytest.raises(ValueError, match="at most"):
        ask([], ms, [need("c1", 1)] * (MAX_WHATIF_NEEDS + 1))
