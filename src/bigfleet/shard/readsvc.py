"""ShardRead (read-only inspection) and ShardAdmin (pause / dry-run) services.

Served on the same port as Shard. What InspectNeeds and ListShortfalls return
is soft state from the last cycle; GetInventoryCounts is live.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import grpc

from bigfleet.decision.consolidation import plan_on_copy
from bigfleet.decision.types import Verdict
from bigfleet.decision.whatif import MAX_WHATIF_NEEDS, Result, what_if
from bigfleet.machine import Machine
from bigfleet.needs import Need, ValidationError
from bigfleet.security.limits import LimitExceeded, check_rollup
from bigfleet.shard.engineproc import row_age, row_resources
from bigfleet.shard.ha.node import RaftError
from bigfleet.v1alpha1 import capacity_pb2, coordinator_pb2, provider_pb2, shardread_pb2, shardread_pb2_grpc
from bigfleet.wire.needs import (
    MAX_COLOCATION_GROUP_LEN,
    need_from_proto,
    need_to_proto,
    requirement_to_proto,
    validate_cluster_id,
)

if TYPE_CHECKING:
    from bigfleet.shard.daemon import ShardDaemon

S = provider_pb2.MachineState
#: SetActuationRequest.reason is free text for the log; a bound keeps one call from flooding it
MAX_ACTUATION_REASON = 4096


class ShardReadServicer(shardread_pb2_grpc.ShardReadServicer):
    def __init__(self, daemon: ShardDaemon) -> None:
        self.d = daemon
        # One what-if at a time: each is an engine pass per candidate over the whole shard.
        self._whatif = asyncio.Lock()

    async def InspectNeeds(
        self, request: shardread_pb2.InspectNeedsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[shardread_pb2.InspectNeedsResponse]:
        if request.limit < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "limit must be >= 0")
        await _check_cluster_filter(request.cluster_id, context)
        rec = self.d.last
        needs = [n for n in rec.needs if not request.cluster_id or n.cluster_id == request.cluster_id]
        yield shardread_pb2.InspectNeedsResponse(
            header=shardread_pb2.InspectNeedsHeader(
                cycle=rec.cycle, computed_at_unix_nanos=rec.computed_at_unix_nanos, total_needs=len(needs)
            )
        )
        verdicts = {(v.cluster_id, v.fingerprint): v for v in (rec.decision.verdicts if rec.decision else ())}
        if request.limit:
            needs = needs[: request.limit]
        for n in needs:
            view = shardread_pb2.NeedView(
                need=need_to_proto(n), cluster_id=n.cluster_id, arrival_unix_nanos=n.arrival_unix_nanos,
                profile_fingerprint=n.fingerprint,
            )
            view.bootstrap_error = self.d.executor.bootstrap_failures.get((n.cluster_id, n.fingerprint), "")
            v = verdicts.get((n.cluster_id, n.fingerprint))
            row = rec.verdict_rows.get((n.cluster_id, n.fingerprint)) if v is None else None
            if row is not None:
                _fill_from_row(view, row, rec.decision.state.cycle if rec.decision is not None else 0)
            if v is not None:
                _fill_from_verdict(view, v, rec.decision.state.cycle if rec.decision is not None else 0)
            yield shardread_pb2.InspectNeedsResponse(need=view)

    async def GetInventoryCounts(
        self, request: shardread_pb2.InventoryCountsRequest, context: grpc.aio.ServicerContext
    ) -> shardread_pb2.InventoryCounts:
        # From the view's kept counts and cluster index (this also backs the dashboard, polled every
        # few seconds on shards of 100 000s of machines): no provider record is parsed.
        await _check_cluster_filter(request.cluster_id, context)
        per_state, bound, total, inflight = self.d.view.census(request.cluster_id)
        by_state = {S.Name(st): n for st, n in per_state.items()}  # type: ignore[arg-type]
        return shardread_pb2.InventoryCounts(
            by_state=by_state, total=total, in_flight=inflight, shard_epoch=self.d.config.epoch,
            bound_by_cluster=bound, reconciled=self.d.reconciled.is_set(),
        )

    async def ListShortfalls(
        self, request: shardread_pb2.ListShortfallsRequest, context: grpc.aio.ServicerContext
    ) -> shardread_pb2.ListShortfallsResponse:
        if request.limit < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "limit must be >= 0")
        rec = self.d.last
        out = shortfalls_to_proto(rec.decision.shortfalls if rec.decision else ())
        if request.limit:
            out = out[: request.limit]
        return shardread_pb2.ListShortfallsResponse(cycle=rec.cycle, shortfalls=out)


    async def WhatIf(
        self, request: shardread_pb2.WhatIfRequest, context: grpc.aio.ServicerContext
    ) -> shardread_pb2.WhatIfResponse:
        """Run the engine on a copy of this leader's state with the candidates added; actuate and
        replicate nothing (decision/whatif.py)."""
        d, m = self.d, self.d.metrics
        try:
            cluster, cands = _whatif_input(request, d.config.wall_ns())
        except (ValidationError, LimitExceeded) as exc:
            m.whatif_calls.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"what-if: {exc}")
        if cluster in d.frozen_clusters:
            m.whatif_calls.labels("unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cluster {cluster!r} is being handed to another shard")
        if not d.reconciled.is_set():
            m.whatif_calls.labels("unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the shard has not read its inventory yet; retry")
        async with self._whatif:
            t0 = time.perf_counter()
            # The copy is taken on the loop (records are immutable; the lists are ours), the engine
            # runs off it so sessions keep being served.
            fc, fm = d.frozen_clusters, d.frozen_machines
            needs = [n for n in d.store.table.snapshot() if n.cluster_id not in fc]
            machines = [x for x in d.view.machines() if x.id not in fm and x.cluster not in fc]
            config = replace(d.config.engine, paused=d.paused, dry_run=d.dry_run)
            now, cycle = d.config.wall_ns(), d.cycles
            state = d.store.engine_state()
            try:
                if d.config.compute_inline:  # (the simulator's virtual clock: no threads)
                    res = what_if(needs, machines, now, state, config, cluster, cands)
                else:
                    res = await asyncio.to_thread(what_if, needs, machines, now, state, config, cluster, cands)
            except ValueError as exc:  # (input already checked: defensive)
                m.whatif_calls.labels("invalid").inc()
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"what-if: {exc}")
            m.whatif_duration.observe(time.perf_counter() - t0)
        m.whatif_calls.labels("ok").inc()
        return whatif_to_proto(res, cycle, now)


    async def PlanConsolidation(
        self, request: shardread_pb2.PlanConsolidationRequest, context: grpc.aio.ServicerContext
    ) -> shardread_pb2.PlanConsolidationResponse:
        """Consolidation's plan on a copy of this leader's state, as if it were on; acts on nothing."""
        d = self.d
        await _check_cluster_filter(request.cluster_id, context)
        if not d.reconciled.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the shard has not read its inventory yet; retry")
        async with self._whatif:
            fc, fm = d.frozen_clusters, d.frozen_machines
            needs = [n for n in d.store.table.snapshot() if n.cluster_id not in fc]
            machines = [x for x in d.view.machines() if x.id not in fm and x.cluster not in fc]
            config, now, cycle, state = d.engine_config(), d.config.wall_ns(), d.cycles, d.store.engine_state()
            args = (needs, machines, now, state, config, request.cluster_id)
            if d.config.compute_inline:
                plan, enabled = plan_on_copy(*args)
            else:
                plan, enabled = await asyncio.to_thread(plan_on_copy, *args)
        by_id = {x.id: x for x in machines}
        out = shardread_pb2.PlanConsolidationResponse(cycle=cycle, savings_per_hour=round(plan.saving, 6),
                                                      enabled_clusters=sorted(enabled))
        for mv in (*plan.retired, *plan.moves):
            pb = out.moves.add(cluster_id=mv.cluster_id, need_fingerprint=mv.need_fingerprint, kind=mv.kind,
                               savings_per_hour=round(mv.saving_per_hour, 6), enabled=mv.cluster_id in enabled)
            if mv.new:
                _planned(pb.replacement, by_id.get(mv.new), mv.new)
            for mid in mv.old:
                _planned(pb.replaced.add(), by_id.get(mid), mid)
        return out


def _planned(pb: shardread_pb2.PlannedMachine, m: Machine | None, mid: str) -> None:
    pb.machine_id = mid
    if m is not None:
        pb.instance_type, pb.zone = m.shape.instance_type, m.shape.zone
        pb.state, pb.price_per_hour = m.state.name.lower(), m.shape.price_per_hour


def _whatif_input(request: shardread_pb2.WhatIfRequest, now: int) -> tuple[str, list[Need]]:
    """The request's cluster and candidate needs, checked as a roll-up would be; raises
    ValidationError / LimitExceeded naming the bad field."""
    cluster = validate_cluster_id(request.cluster_id)
    if not request.needs:
        raise ValidationError("needs", "at least one need is required")
    if len(request.needs) > MAX_WHATIF_NEEDS:
        raise ValidationError("needs", f"{len(request.needs)} needs, at most {MAX_WHATIF_NEEDS}")
    check_rollup(capacity_pb2.ClusterCapacityNeeds(cluster_id=cluster, needs=request.needs))
    out = []
    for i, pb in enumerate(request.needs):
        if len(pb.group) > MAX_COLOCATION_GROUP_LEN:
            raise ValidationError(f"needs[{i}].group", f"longer than {MAX_COLOCATION_GROUP_LEN} characters")
        n = need_from_proto(pb, cluster, now, f"needs[{i}]")
        if n.aggregate_resources.is_zero():
            raise ValidationError(f"needs[{i}].aggregate_resources", "must not be empty")
        out.append(n)
    return cluster, out


def whatif_to_proto(res: Result, cycle: int, now: int) -> shardread_pb2.WhatIfResponse:
    out = shardread_pb2.WhatIfResponse(cycle=cycle, computed_at_unix_nanos=now, all_satisfiable=res.all_satisfiable)
    for a in res.answers:
        pb = out.answers.add(
            index=a.index, profile_fingerprint=a.fingerprint, outcome=int(a.outcome),
            bound_count=a.bound, idle_count=a.idle, speculative_count=a.speculative, victims=a.victims,
            unmet_reason=int(a.unmet_reason) if int(a.unmet_reason) <= 4 else 0,
            message=a.message(),
        )
        for prio, count in a.victim_priorities:
            pb.victim_priorities.add(priority=prio, machines=count)
        for cid, fp, prio in a.displaced:
            pb.displaced.add(cluster_id=cid, profile_fingerprint=fp, priority=prio)
        if a.residual:
            pb.residual_deficit.resources.update(a.residual.to_wire())
    return out


def _fill_from_verdict(view: shardread_pb2.NeedView, v: Verdict, cycle: int) -> None:
    """A need's view from its `Verdict` (thread and inline modes)."""
    view.satisfied = v.satisfied
    view.claimed_machine_count = v.claimed_count
    view.bootstrap_count = v.bootstrap_count
    view.provision_count = v.provision_count
    view.same_domain = v.same_domain
    view.same_satisfiable = v.same_satisfiable
    view.acquisition_parked = v.parked
    view.parked_age_cycles = v.parked_age_cycles
    view.age_cycles_unmet = v.age_at(cycle)
    reason = int(v.unmet_reason)
    view.unmet_reason = reason if reason <= 4 else 0  # type: ignore[assignment]
    if not v.satisfied:
        view.residual_deficit.resources.update(v.deficit.to_wire())
        ms = v.matching_supply
        view.matching_supply.CopyFrom(
            shardread_pb2.MatchingSupply(idle=ms.idle, configured=ms.configured, speculative=ms.speculative, capped=ms.capped)
        )
        if reason == 4:
            view.preemption.victims_found = v.victims_found
            if v.capacity_freed is not None:
                view.preemption.capacity_freed.resources.update(v.capacity_freed.to_wire())


def _fill_from_row(view: shardread_pb2.NeedView, row: tuple[Any, ...], cycle: int) -> None:
    """The worker/fork-mode twin of `_fill_from_verdict` (row layout: engineproc.verdict_row)."""
    (satisfied, claimed, boot, prov, domain, same_sat, parked, parked_since, unmet_since, reason, deficit,
     ms, victims, freed, _configured) = row
    parked_age, age_unmet = row_age(parked_since, cycle), row_age(unmet_since, cycle)
    view.satisfied = bool(satisfied)
    view.claimed_machine_count = int(claimed)
    view.bootstrap_count = int(boot)
    view.provision_count = int(prov)
    view.same_domain = str(domain)
    view.same_satisfiable = bool(same_sat)
    view.acquisition_parked = bool(parked)
    view.parked_age_cycles = int(parked_age)
    view.age_cycles_unmet = int(age_unmet)
    r = int(reason)
    view.unmet_reason = r if r <= 4 else 0  # type: ignore[assignment]
    if not satisfied:
        view.residual_deficit.resources.update(row_resources(deficit))
        idle, configured, spec, capped = ms
        view.matching_supply.CopyFrom(shardread_pb2.MatchingSupply(
            idle=idle, configured=configured, speculative=spec, capped=capped))
        if r == 4:
            view.preemption.victims_found = int(victims)
            view.preemption.capacity_freed.resources.update(row_resources(freed))


def shortfalls_to_proto(shortfalls: object) -> list[coordinator_pb2.Shortfall]:
    out = []
    for sf in shortfalls:  # type: ignore[attr-defined]
        out.append(
            coordinator_pb2.Shortfall(
                requirements=[requirement_to_proto(r) for r in sf.requirements],
                deficit=provider_pb2.Resources(resources=sf.deficit.to_wire()),
                priority=sf.priority,
                age_cycles=sf.age_cycles,
                interruption_penalty_bucket=int(sf.interruption_bucket),  # type: ignore[arg-type]
                min_unit=provider_pb2.Resources(resources=sf.min_unit.to_wire()),
            )
        )
    return out


class ShardAdminServicer(shardread_pb2_grpc.ShardAdminServicer):
    def __init__(self, daemon: ShardDaemon) -> None:
        self.d = daemon

    def _status(self) -> shardread_pb2.ActuationStatus:
        return shardread_pb2.ActuationStatus(paused=self.d.paused, dry_run=self.d.dry_run, cycle=self.d.cycles)

    async def GetActuation(
        self, request: shardread_pb2.GetActuationRequest, context: grpc.aio.ServicerContext
    ) -> shardread_pb2.ActuationStatus:
        return self._status()

    async def SetActuation(
        self, request: shardread_pb2.SetActuationRequest, context: grpc.aio.ServicerContext
    ) -> shardread_pb2.ActuationStatus:
        if len(request.reason) > MAX_ACTUATION_REASON:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"reason: {len(request.reason)} characters, limit {MAX_ACTUATION_REASON}")
        try:
            await self.d.set_actuation(request.paused, request.dry_run, request.reason, context.peer())
        except RaftError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"actuation not changed: {exc}")
        return self._status()


async def _check_cluster_filter(cluster_id: str, context: grpc.aio.ServicerContext) -> None:
    """An optional cluster filter ("" = every cluster) must be an id a cluster could have: the same
    INVALID_ARGUMENT on every ShardRead call, not an empty answer for a typo'd id."""
    if cluster_id:
        try:
            validate_cluster_id(cluster_id)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
