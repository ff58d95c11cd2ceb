"""Pure mapping of the shard's per-need verdicts onto CapacityRequest status and Events.

A CapacityRequest is folded into one need of the roll-up; the shard's ``NeedVerdicts`` frame tells,
per need fingerprint, whether it is met and why not. Every CR of a need gets the same status:

* ``conditions``: ``Satisfied`` and its complement ``Unsatisfied`` (both always present, so
  ``kubectl wait --for=condition=Satisfied`` and an alert on ``Unsatisfied`` both work; ``reason`` is
  the engine's unmet reason in CamelCase, ``Satisfied`` when met), and ``Escalated`` (the shortfall
  is old enough for cross-shard rebalancing). ``lastTransitionTime`` changes only when a status flips.
* ``machines``: ``bound`` (Configured), ``coming`` (being created or configured), ``missing``;
* ``shortfall`` (only while unmet): ``since``, ``escalated``, ``deficit``, ``preemptionVictims``;
* ``observedGeneration`` and ``needFingerprint``.

The Events a verdict raises are derived from the CR's previous status (so an operator restart does
not repeat them): ``Shortfall`` when a need becomes unmet or its reason changes, ``Escalated``,
``Provisioning`` when more machines are coming than before, ``Preempting`` when Phase 2 found
victims for it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bigfleet.needs import ValidationError, format_quantity, parse_quantity
from bigfleet.operator.events import NORMAL, WARNING
from bigfleet.v1alpha1 import shard_pb2, shardread_pb2

SATISFIED = "Satisfied"
UNSATISFIED = "Unsatisfied"
ESCALATED = "Escalated"

REASONS: dict[int, str] = {
    shardread_pb2.UNMET_REASON_PRIORITY_STARVED: "PriorityStarved",
    shardread_pb2.UNMET_REASON_NO_MATCHING_SUPPLY: "NoMatchingSupply",
    shardread_pb2.UNMET_REASON_TOPOLOGY_UNSATISFIABLE: "TopologyUnsatisfiable",
    shardread_pb2.UNMET_REASON_PREEMPTION_EXHAUSTED: "PreemptionExhausted",
}
EXPLAIN: dict[str, str] = {
    "PriorityStarved": "matching machines are held by needs of equal or higher priority",
    "NoMatchingSupply": "no machine of a fitting shape exists in any state",
    "TopologyUnsatisfiable": "the co-location (Same) constraint cannot be met inside this shard",
    "PreemptionExhausted": "lower-priority machines were found to preempt, but not enough",
    "Unmet": "the shard could not place all of it this cycle",
    "ActuationPaused": "the shard's actuation is paused (or in dry-run), so the machines it chose for this need "
                       "are not being configured or created; it goes ahead when the shard is resumed",
}


def reason_of(v: shard_pb2.NeedVerdict) -> str:
    if v.satisfied:
        return SATISFIED
    if v.actuation_paused:
        return "ActuationPaused"
    return REASONS.get(int(v.unmet_reason), "Unmet")


def _resources(m: Mapping[str, str]) -> str:
    out = []
    for k, q in sorted(m.items()):
        try:
            out.append(f"{k}={format_quantity(parse_quantity(q))}")
        except ValidationError:
            continue
    return ", ".join(out)


def message_of(v: shard_pb2.NeedVerdict) -> str:
    if v.satisfied:
        msg = f"{v.machines_bound} machine(s) serve this need"
        if v.machines_coming:
            msg += f"; {v.machines_coming} more being created or configured"
        return msg
    reason = reason_of(v)
    parts = [f"{EXPLAIN[reason]}"]
    deficit = _resources(v.deficit.resources)
    if deficit:
        parts.append(f"missing {deficit} (about {v.machines_missing} machine(s))")
    ms = v.matching_supply
    parts.append(f"matching machines: {ms.idle} idle, {ms.configured} configured, {ms.speculative} speculative"
                 + (" (capped)" if ms.capped else ""))
    if v.machines_bound or v.machines_coming:
        parts.append(f"{v.machines_bound} serving, {v.machines_coming} coming")
    if v.victims_found:
        parts.append(f"preempting {v.victims_found} lower-priority machine(s)")
    if v.bootstrap_error:
        parts.append(f"last bootstrap failed: {v.bootstrap_error[:300]}")
    return "; ".join(parts)


def rfc3339_of_ns(unix_nanos: int) -> str:
    return dt.datetime.fromtimestamp(unix_nanos / 1e9, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(cur: Mapping[str, Any] | None, ctype: str, status: str, reason: str, message: str,
               generation: int, now: str) -> dict[str, Any]:
    keep = cur is not None and cur.get("status") == status and cur.get("lastTransitionTime")
    return {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": cur["lastTransitionTime"] if keep and cur is not None else now,
        "observedGeneration": generation,
    }


@dataclass(frozen=True)
class Planned:
    """What a verdict means for one CR: the status fields to merge-patch (None: already there) and
    the Events to raise, as (type, reason, message)."""

    status: dict[str, Any] | None
    events: tuple[tuple[str, str, str], ...]


def plan_status(v: shard_pb2.NeedVerdict, frame: shard_pb2.NeedVerdicts, generation: int,
                current: Mapping[str, Any] | None, now: str) -> Planned:
    """The status a CR of the need ``v`` should have, given its ``current`` status."""
    cur = current or {}
    conds = {c.get("type"): c for c in (cur.get("conditions") or []) if isinstance(c, Mapping)}
    reason = reason_of(v)
    message = message_of(v)
    met = "True" if v.satisfied else "False"
    unmet = "False" if v.satisfied else "True"
    conditions = [
        _condition(conds.get(SATISFIED), SATISFIED, met, reason, message, generation, now),
        _condition(conds.get(UNSATISFIED), UNSATISFIED, unmet, reason, message, generation, now),
    ]
    esc_msg = (f"unmet for {v.shortfall_age_cycles} cycles ({v.shortfall_age_seconds}s): other shards may supply it"
               if v.escalated else "not escalated")
    conditions.append(_condition(conds.get(ESCALATED), ESCALATED, "True" if v.escalated else "False",
                                 "ShortfallAged" if v.escalated else "NotEscalated", esc_msg, generation, now))
    machines = {"bound": int(v.machines_bound), "coming": int(v.machines_coming),
                "missing": int(v.machines_missing)}
    shortfall: dict[str, Any] | None = None
    prev_short = cur.get("shortfall") if isinstance(cur.get("shortfall"), Mapping) else None
    was_unmet = (conds.get(SATISFIED) or {}).get("status") == "False"
    if not v.satisfied:
        since = (prev_short or {}).get("since") if was_unmet else None
        if not since:
            since = rfc3339_of_ns(max(0, frame.computed_at_unix_nanos - int(v.shortfall_age_seconds) * 1_000_000_000))
        shortfall = {"since": since, "escalated": bool(v.escalated),
                     "deficit": dict(sorted(v.deficit.resources.items()))}
        if v.victims_found:
            shortfall["preemptionVictims"] = int(v.victims_found)
    want: dict[str, Any] = {
        "observedGeneration": generation,
        "needFingerprint": v.fingerprint,
        "machines": machines,
        "conditions": conditions,
        "shortfall": shortfall,
    }
    patch = {k: val for k, val in want.items() if cur.get(k) != val}
    if "shortfall" in patch and shortfall is not None and prev_short is not None:
        # merge-patch semantics: a key that disappeared from the map must be nulled out
        patch["shortfall"] = {**{k: None for k in prev_short if k not in shortfall}, **shortfall}
        if "deficit" in shortfall and isinstance(prev_short.get("deficit"), Mapping):
            patch["shortfall"]["deficit"] = {**{k: None for k in prev_short["deficit"] if k not in shortfall["deficit"]},
                                             **shortfall["deficit"]}
    if patch.get("shortfall", 0) is None and "shortfall" not in cur:
        patch.pop("shortfall")
    events: list[tuple[str, str, str]] = []
    prev_reason = (conds.get(SATISFIED) or {}).get("reason")
    if not v.satisfied and (not was_unmet or prev_reason != reason):
        events.append((WARNING, "Shortfall", f"{reason}: {message}"))
    if v.escalated and (conds.get(ESCALATED) or {}).get("status") != "True":
        events.append((WARNING, "Escalated", f"shortfall {esc_msg}"))
    prev_coming = int(((cur.get("machines") or {}) if isinstance(cur.get("machines"), Mapping) else {})
                      .get("coming") or 0)
    if v.machines_coming > prev_coming:
        events.append((NORMAL, "Provisioning", f"{v.machines_coming} machine(s) being created or configured for "
                                               f"this need ({v.machines_bound} serving)"))
    prev_victims = int((prev_short or {}).get("preemptionVictims") or 0) if was_unmet else 0
    if v.victims_found and v.victims_found != prev_victims:
        events.append((NORMAL, "Preempting", f"preempting {v.victims_found} lower-priority machine(s) to serve "
                                             f"this need (priority-ordered; drains honour PodDisruptionBudgets)"))
    return Planned(patch or None, tuple(events))
