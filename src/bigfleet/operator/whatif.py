"""Dry-run CapacityRequests: asked about, never rolled up.

A CR annotated ``bigfleet.lucy.sh/dry-run: "true"`` is left out of the roll-up (rollup.py); this loop
asks the shard what would happen if it were added (ShardRead.WhatIf, one need per CR) and writes the
answer to the CR's ``status.whatIf``. Answers are re-asked when the CR changes and every ``interval``
seconds (the fleet moves on); a CR that loses the annotation is rolled up as usual and its
``status.whatIf`` is removed. A shard that cannot be reached leaves the last answer in place.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from bigfleet.observability import get_logger
from bigfleet.operator.crds import is_dry_run
from bigfleet.operator.handlers import rfc3339
from bigfleet.operator.rollup import cr_need
from bigfleet.security.tls import TLSConfig, dial
from bigfleet.v1alpha1 import capacity_pb2
from bigfleet.v1alpha1 import shardread_pb2 as spb
from bigfleet.v1alpha1 import shardread_pb2_grpc as sgrpc

log = get_logger("bigfleet.operator.whatif")

REDIRECT_METADATA_KEY = "bigfleet-redirect"
#: WhatIf takes at most this many needs per call (decision/whatif.py MAX_WHATIF_NEEDS)
BATCH = 32

Key = tuple[str, str]
#: (namespace, name, the status.whatIf value; None removes it)
Patch = Callable[[str, str, dict[str, Any] | None], Awaitable[None]]
Resolve = Callable[[], Awaitable[str]]


def _camel(outcome: int) -> str:
    name = spb.WhatIfOutcome.Name(outcome).removeprefix("WHAT_IF_OUTCOME_")  # type: ignore[arg-type]
    return name.capitalize()


def _reason(r: int) -> str:
    return "".join(w.capitalize() for w in spb.UnmetReason.Name(r).removeprefix("UNMET_REASON_").split("_"))  # type: ignore[arg-type]


def answer_status(a: spb.WhatIfAnswer, cycle: int, generation: int, now: str) -> dict[str, Any]:
    """The ``status.whatIf`` of one CR from its answer (the CRD's schema, camelCase)."""
    out: dict[str, Any] = {
        "satisfiable": a.outcome != spb.WHAT_IF_OUTCOME_UNSATISFIABLE,
        "outcome": _camel(a.outcome),
        "message": a.message,
        "machines": {"bound": a.bound_count, "idle": a.idle_count, "speculative": a.speculative_count},
        "victims": a.victims,
        "victimPriorities": [{"priority": v.priority, "machines": v.machines} for v in a.victim_priorities],
        "displacedNeeds": len(a.displaced),
        "unmetReason": _reason(a.unmet_reason) if a.unmet_reason else None,
        "deficit": dict(a.residual_deficit.resources) or None,
        "shardCycle": cycle,
        "evaluatedAt": now,
        "observedGeneration": generation,
    }
    return out


def invalid_status(reason: str, generation: int, now: str) -> dict[str, Any]:
    return {"satisfiable": False, "outcome": "Invalid", "message": reason[:1000], "evaluatedAt": now,
            "observedGeneration": generation, "machines": None, "victims": None, "victimPriorities": None,
            "displacedNeeds": None, "unmetReason": None, "deficit": None, "shardCycle": None}


class DryRuns:
    """Answers the cluster's dry-run CapacityRequests (one instance per operator leader term)."""

    def __init__(self, cluster_id: str, items: Callable[[], Sequence[dict[str, Any]]], resolve: Resolve,
                 patch: Patch, tls: TLSConfig | None = None, interval: float = 60.0, timeout: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cluster_id = cluster_id
        self.items = items
        self.resolve = resolve
        self.patch = patch
        self.tls = tls
        self.interval = interval
        self.timeout = timeout
        self.clock = clock
        self.due = asyncio.Event()
        #: CR -> (generation answered, when)
        self.answered: dict[Key, tuple[int, float]] = {}
        self.calls = 0

    async def run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.due.wait(), max(1.0, self.interval / 4))
            except TimeoutError:
                pass
            self.due.clear()
            try:
                await self.answer_once()
            except Exception as exc:  # the loop outlives a bad round (logged, retried)
                log.warning("dry-run answers failed", error=str(exc)[:300])

    async def answer_once(self) -> int:
        """Ask about every dry-run CR that is new, changed or stale; returns how many were written."""
        now = self.clock()
        todo: list[tuple[Key, int, dict[str, Any]]] = []
        live: set[Key] = set()
        written = 0
        for obj in self.items():
            meta = obj.get("metadata") or {}
            key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
            status = obj.get("status") or {}
            if not is_dry_run(obj) or meta.get("deletionTimestamp"):
                if status.get("whatIf") is not None and not meta.get("deletionTimestamp"):
                    await self.patch(key[0], key[1], None)  # rolled up now: the old answer would mislead
                    written += 1
                continue
            live.add(key)
            gen = int(meta.get("generation") or 0)
            prev = self.answered.get(key)
            if prev is not None and prev[0] == gen and now - prev[1] < self.interval:
                continue
            todo.append((key, gen, obj))
        for k in [k for k in self.answered if k not in live]:
            del self.answered[k]
        stamp = rfc3339()
        asks: list[tuple[Key, int, capacity_pb2.CapacityNeed]] = []
        for key, gen, obj in todo:
            need = cr_need(obj)
            if isinstance(need, str):
                await self.patch(key[0], key[1], invalid_status(need, gen, stamp))
                self.answered[key] = (gen, now)
                written += 1
            else:
                asks.append((key, gen, need))
        for i in range(0, len(asks), BATCH):
            batch = asks[i:i + BATCH]
            try:
                resp = await self.ask([n for _, _, n in batch])
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    log.warning("what-if call failed; the last answers stay", code=exc.code().name,
                                error=(exc.details() or "")[:200])
                    return written
                for key, gen, _ in batch:
                    await self.patch(key[0], key[1], invalid_status(exc.details() or "refused", gen, stamp))
                    self.answered[key] = (gen, now)
                    written += 1
                continue
            for a in resp.answers:
                key, gen, _ = batch[a.index]
                await self.patch(key[0], key[1], answer_status(a, resp.cycle, gen, stamp))
                self.answered[key] = (gen, now)
                written += 1
        return written

    async def ask(self, needs: list[capacity_pb2.CapacityNeed]) -> spb.WhatIfResponse:
        """WhatIf on the cluster's shard; a follower's redirect is followed once."""
        self.calls += 1
        addr = await self.resolve()
        req = spb.WhatIfRequest(cluster_id=self.cluster_id, needs=needs)
        for attempt in (1, 2):
            async with dial(addr, self.tls) as ch:
                try:
                    resp: spb.WhatIfResponse = await sgrpc.ShardReadStub(ch).WhatIf(req, timeout=self.timeout)
                    return resp
                except grpc.aio.AioRpcError as exc:
                    hint = dict(exc.trailing_metadata() or ()).get(REDIRECT_METADATA_KEY, "")
                    if attempt == 1 and exc.code() == grpc.StatusCode.UNAVAILABLE and isinstance(hint, str) and hint:
                        addr = hint
                        continue
                    raise
        raise AssertionError("unreachable")
