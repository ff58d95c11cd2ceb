"""Turns the engine's actions into fenced provider calls and operator frames, off the cycle's path.

One mutation per machine at a time (a ledger of machines in flight drops
duplicates). Each flow marks the machine in its transitional state *before*
calling out, so the next cycle already counts it, and ends in a stable state
observed from the provider, in the provider's record re-read after a lost race
(another shard or actor got there first: never FAILED for that), or in FAILED
with ``last_error`` (a timeout, a FAILED record, or an error on a machine in the
state the call needed): a machine is never silently forgotten, and never handed
out twice. A Configured machine is drained only after its cluster's operator
received the ReclaimInstruction and acked it or let its grace run out.

Throughput (the reprovisioning regime hands out thousands of machines at
once): ``concurrency`` bounds provider mutations in flight and
``bootstrap_concurrency`` bootstrap pulls, not whole flows, so a flow waiting
for the provider to finish a transition costs nothing; steps of flows already under
way go before new flows, so machines finish instead of piling up half done.
Lifecycle calls are asynchronous (the ack is usually still transitional), and
completions are observed through one shared incremental List
(``since_revision``) for all waiting flows instead of per-machine Get polling.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from bigfleet.machine import Assignment
from bigfleet.observability import get_logger
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.provider_client import ProviderError
from bigfleet.shard.providers import ShardProvider
from bigfleet.shard.sessions import BootstrapUnavailable, ReclaimSent, SessionRegistry
from bigfleet.shard.view import MachineView, node_name
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2
from bigfleet.wire.machine import encode_shard_metadata

log = get_logger("bigfleet.shard.executor")

S = provider_pb2.MachineState


@dataclass(frozen=True)
class Binding:
    """Everything Configure needs: who the machine is for and what protects it."""

    cluster_id: str
    need_fingerprint: str
    priority: int
    interruption_penalty_dollars: float
    reclamation_penalty_dollars: float
    requirements: tuple[capacity_pb2.NodeSelectorRequirement, ...]

    group: str = ""

    def metadata(self) -> dict[str, str]:
        """The assignment keys (computed once per binding; callers must not mutate the dict)."""
        md: dict[str, str] | None = self.__dict__.get("_metadata")
        if md is None:
            md = encode_shard_metadata(
                Assignment(self.priority, self.interruption_penalty_dollars, self.reclamation_penalty_dollars,
                           self.need_fingerprint, self.group)
            )
            object.__setattr__(self, "_metadata", md)
        return md


@dataclass(frozen=True)
class ExecutorConfig:
    # Provider mutations in flight at once (a flow waiting for a transition to finish holds none).
    concurrency: int = 256
    # Bootstrap pulls outstanding at once, a separate bound: a slow operator round trip must not
    # starve provider calls of slots.
    bootstrap_concurrency: int = 1024
    execute_timeout: float = 30.0  # how long a transition may take before the machine is FAILED
    bootstrap_timeout: float = 30.0
    reclaim_ack_timeout: float = 10.0
    poll_interval: float = 0.1  # Get polling (``watch=False``)
    # Observe completions with one shared incremental List for every waiting flow; False polls
    # Get per machine (what the deterministic simulator's golden traces were recorded with).
    watch: bool = True
    watch_interval: float = 0.05  # least time between two watch Lists
    watch_full_after: float = 10.0  # a flow waiting this long gets a Get of its machine (at most 64 per round)
    # A slot whose Create the provider refused for capacity (RESOURCE_EXHAUSTED) is shown FAILED this
    # long, then offered to the engine again.
    capacity_cooldown: float = 60.0


class Slots:
    """A semaphore with two queues: urgent waiters (steps of flows already under way) go first."""

    def __init__(self, n: int) -> None:
        self.free = max(1, n)
        self._urgent: deque[asyncio.Future[None]] = deque()
        self._normal: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._urgent) + len(self._normal)

    async def acquire(self, urgent: bool) -> None:
        if self.free > 0 and not self._urgent and not self._normal:
            self.free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        (self._urgent if urgent else self._normal).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over as we were cancelled: pass it on
            else:
                q = self._urgent if urgent else self._normal
                if fut in q:
                    q.remove(fut)
            raise

    def release(self) -> None:
        for q in (self._urgent, self._normal):
            while q:
                fut = q.popleft()
                if not fut.done():
                    fut.set_result(None)  # the slot passes directly to the waiter
                    return
        self.free += 1


class _MovedAway(Exception):
    """The machine left the transition's path (another actor moved it): not ours to finish."""

    def __init__(self, machine: provider_pb2.Machine) -> None:
        super().__init__(f"machine is {S.Name(machine.state)}")
        self.machine = machine


class _Waiter:
    __slots__ = ("checked", "fut", "gen", "on_path", "since", "targets")

    def __init__(self, fut: asyncio.Future[provider_pb2.Machine], targets: frozenset[int], gen: int,
                 since: float, on_path: frozenset[int] | None = None) -> None:
        self.fut = fut
        self.targets = targets
        self.gen = gen
        self.since = since
        self.checked = since  # when this flow's machine was last looked at directly (a Get)
        # The states the machine may show while the transition is under way (its start and its
        # transitional state); one outside these, the targets and FAILED means it was moved away.
        self.on_path = on_path

    def resolves(self, state: int) -> bool:
        return state in self.targets or state == S.MACHINE_STATE_FAILED or (
            self.on_path is not None and state not in self.on_path)


class Executor:
    def __init__(
        self,
        view: MachineView,
        provider: ShardProvider,
        sessions: SessionRegistry,
        resolve_binding: Callable[[str, str, int], Binding | None],
        config: ExecutorConfig,
        metrics: ShardMetrics | None = None,
        on_settled: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # ``clock`` is injectable so the simulator can run these flows on a virtual event-loop clock.
        self.clock = clock
        self.view = view
        self.provider = provider
        self.sessions = sessions
        self.resolve_binding = resolve_binding
        self.config = config
        self.metrics = metrics
        self.on_settled = on_settled
        self._slots = Slots(config.concurrency)
        self._bootstrap_slots = Slots(config.bootstrap_concurrency)
        self._outcome_children: dict[tuple[str, str], Any] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.bootstrap_failures: dict[tuple[str, str], str] = {}
        # The completion watcher: machine id -> the flow waiting for it to reach a state.
        self._waiters: dict[str, _Waiter] = {}
        self._watch_task: asyncio.Task[None] | None = None
        self._watch_gen = 0
        self._watch_cursor = b""
        self._watch_last_full = float("-inf")
        self._watch_list_at = float("-inf")  # when the last watch List started (pacing spans watch tasks)
        # Machines whose flow ended while the current watch List was in flight (see _watch).
        self._ended_during_list: set[str] = set()
        # Counters tests and benchmarks read (the RPCs themselves are in the provider metrics).
        self.watch_lists = 0
        self.confirm_gets = 0
        self.rechecks = 0
        # When each machine's last flow ended (a sequence number), so a List that was already in
        # flight then is not applied over the flow's newer record (see ended_after()).
        self._end_seq = 0
        self._ended_at: dict[str, int] = {}

    @property
    def inflight(self) -> int:
        return len(self.view.inflight)

    def _outcome(self, kind: str, outcome: str) -> None:
        if self.metrics:
            child = self._outcome_children.get((kind, outcome))
            if child is None:
                child = self._outcome_children[(kind, outcome)] = self.metrics.action_outcomes.labels(kind, outcome)
            child.inc()

    # -- submission (synchronous, called from the cycle) ---------------------------------------

    def submit_create(self, machine_id: str, binding: Binding | None) -> bool:
        pb = self._claim(machine_id, "Provision", S.MACHINE_STATE_SPECULATIVE)
        if pb is None:
            return False
        shown = _copy(pb)
        shown.state = S.MACHINE_STATE_CREATING
        if binding is not None:
            self.view.reserved_for[machine_id] = binding.cluster_id
            shown.shard_metadata.clear()
            shown.shard_metadata.update(binding.metadata())
        if not self.view.set(shown):
            self.view.reserved_for.pop(machine_id, None)
            self.view.inflight.pop(machine_id, None)
            return False
        self._spawn("Provision", machine_id, self._provision(machine_id, binding))
        return True

    def submit_configure(self, machine_id: str, binding: Binding) -> bool:
        pb = self._claim(machine_id, "Bootstrap", S.MACHINE_STATE_IDLE)
        if pb is None:
            return False
        self._show_configuring(pb, binding)
        self._spawn("Bootstrap", machine_id, self._configure_flow(machine_id, binding))
        return True

    def submit_drain(self, machine_id: str, grace_seconds: int, preemptor_priority: int, reason: str) -> bool:
        kind = "Preempt" if reason == "preempt" else "Reclaim"
        pb = self._claim(machine_id, kind, S.MACHINE_STATE_CONFIGURED)
        if pb is None:
            return False
        cluster = pb.cluster
        shown = _copy(pb)
        shown.state = S.MACHINE_STATE_DRAINING
        self.view.set(shown)
        self._spawn(kind, machine_id, self._drain_flow(machine_id, cluster, node_name(pb), grace_seconds, preemptor_priority))
        return True

    def submit_delete(self, machine_id: str) -> bool:
        pb = self._claim(machine_id, "Delete", S.MACHINE_STATE_IDLE)
        if pb is None:
            return False
        shown = _copy(pb)
        shown.state = S.MACHINE_STATE_DELETING
        self.view.set(shown)
        self._spawn("Delete", machine_id, self._delete_flow(machine_id))
        return True

    def _claim(self, machine_id: str, kind: str, required: int) -> provider_pb2.Machine | None:
        if machine_id in self.view.inflight:
            if self.metrics:
                self.metrics.actions_deduped.inc()
            return None
        pb = self.view.get(machine_id)
        if pb is None or pb.state != required or machine_id in self.view.failed_local:
            self._outcome(kind, "not_applicable")
            return None
        self.view.inflight[machine_id] = kind
        # What the provider last said of it (the view showed exactly that until now): the record a
        # flow that does not happen hands the machine back to.
        self.view.provider_latest[machine_id] = pb
        return pb

    @asynccontextmanager
    async def _step(self, urgent: bool, slots: Slots | None = None) -> AsyncIterator[None]:
        """Hold one slot (of ``concurrency`` for a provider mutation by default) for one step."""
        slots = slots or self._slots
        await slots.acquire(urgent)
        if self.metrics:
            self.metrics.execute_inflight.inc()
        try:
            yield
        finally:
            slots.release()
            if self.metrics:
                self.metrics.execute_inflight.dec()

    def _spawn(self, kind: str, machine_id: str, coro: Any) -> None:
        async def run() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                self._outcome(kind, "ctx_canceled")
                raise
            except Exception as exc:  # a bug must not leave the machine owned forever
                log.exception("action crashed", kind=kind, machine=machine_id)
                self._fail(machine_id, f"{kind}: internal error: {exc}")
                self._outcome(kind, "internal_error")
            finally:
                w = self._waiters.pop(machine_id, None)
                if w is not None and not w.fut.done():
                    w.fut.cancel()
                self._ended_during_list.add(machine_id)
                self._end_seq += 1
                self._ended_at[machine_id] = self._end_seq
                self.view.inflight.pop(machine_id, None)
                self.view.reserved_for.pop(machine_id, None)
                if self.on_settled:
                    self.on_settled()

        task = asyncio.create_task(run(), name=f"{kind}-{machine_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def end_mark(self) -> int:
        """A marker to take before a List call; see ``ended_after``."""
        return self._end_seq

    def ended_after(self, machine_id: str, mark: int) -> bool:
        """True if a flow on ``machine_id`` ended after ``mark`` was taken: a List started before then
        may hold an older record than the one that flow left in the view (applying it would show,
        e.g., a just-Configured machine as Idle and have it configured for a second cluster)."""
        return self._ended_at.get(machine_id, 0) > mark

    def recheck(self, listed: provider_pb2.Machine) -> None:
        """A List record set aside by ``ended_after``: if it differs from the view, read the machine
        fresh, so a provider-side change that List carried is not lost until the next full reconcile."""
        machine_id = listed.id
        if self.view.shows(listed) or machine_id in self.view.inflight:
            return  # nothing new in it (or a new flow owns the machine and will observe it)

        async def one() -> None:
            self.rechecks += 1
            mark = self.end_mark()
            try:
                pb = await self.provider.get(machine_id, total=5.0)
            except ProviderError:
                return  # (NOT_FOUND and the like are the full reconcile's business)
            if not self.ended_after(machine_id, mark):
                self.view.observe(pb)  # (a no-op while a new flow owns the machine)

        task = asyncio.create_task(one(), name=f"recheck-{machine_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def running(self) -> set[asyncio.Task[None]]:
        """The flows still running (the simulator waits for them at the end of a run)."""
        return set(self._tasks)

    async def drain_all(self, timeout: float) -> None:
        """Wait for in-flight actions (used at shutdown); cancel what is left after ``timeout``."""
        if not self._tasks:
            return
        _done, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)

    # -- flows ---------------------------------------------------------------------------------

    def _fail(self, machine_id: str, error: str) -> None:
        log.warning("machine failed", machine=machine_id, error=error)
        self.view.mark_failed(machine_id, error)

    def _show_configuring(self, pb: provider_pb2.Machine, binding: Binding) -> None:
        shown = _copy(pb)
        shown.state = S.MACHINE_STATE_CONFIGURING
        shown.cluster = binding.cluster_id
        shown.shard_metadata.clear()
        shown.shard_metadata.update(binding.metadata())
        self.view.set(shown)

    def _release_to(self, machine_id: str, base: provider_pb2.Machine | None) -> None:
        """Hand the machine back to the provider's view (e.g. Idle after a bootstrap that did not happen)."""
        latest = self.view.provider_latest.get(machine_id) or base
        if latest is not None:
            self.view.set(latest)

    def _deadline(self, extra: float = 0.0) -> float:
        """When a transition the provider just accepted counts as timed out (queueing for a slot
        before the call does not eat into it: a big backlog must not FAIL machines it never reached)."""
        return self.clock() + self.config.execute_timeout + extra

    async def _wait_state(self, machine_id: str, targets: set[int], deadline: float, *on_path: int) -> provider_pb2.Machine:
        """The machine's record once it reaches one of ``targets`` (or FAILED); TimeoutError at ``deadline``.

        With ``on_path`` (the transition's start and transitional states), a record in any other
        state raises ``_MovedAway``: another actor took the machine, which is a race, not a failure.
        """
        path = frozenset(on_path) if on_path else None
        if not self.config.watch:
            return await self._poll_state(machine_id, targets, deadline, path)
        want = frozenset(targets)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[provider_pb2.Machine] = loop.create_future()
        waiter = _Waiter(fut, want, self._watch_gen, self.clock(), path)
        self._waiters[machine_id] = waiter
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.create_task(self._watch(), name="executor-watch")
        # A timer on the future itself (not wait_for: no extra task or future per waiting flow).
        timer = loop.call_later(max(0.0, deadline - self.clock()), _expire, fut)
        try:
            pb: provider_pb2.Machine | None = await fut
        except TimeoutError:
            pb = None
        finally:
            timer.cancel()
            w = self._waiters.get(machine_id)
            if w is not None and w.fut is fut:
                del self._waiters[machine_id]
        if pb is None:
            # One last direct look before declaring the transition timed out.
            try:
                pb = await self.provider.get(machine_id, total=5.0)
            except ProviderError as exc:
                if exc.code.name == "NOT_FOUND":
                    raise
                raise TimeoutError(str(exc)) from None
            if not waiter.resolves(pb.state):
                self.view.provider_latest[machine_id] = pb
                raise TimeoutError(f"still {S.Name(pb.state)}")
        self.view.provider_latest[machine_id] = pb
        if path is not None and pb.state not in want and pb.state != S.MACHINE_STATE_FAILED and pb.state not in path:
            raise _MovedAway(pb)
        return pb

    async def _poll_state(self, machine_id: str, targets: set[int], deadline: float,
                          on_path: frozenset[int] | None = None) -> provider_pb2.Machine:
        """Poll Get until the machine reaches one of ``targets`` (or FAILED); TimeoutError at ``deadline``."""
        interval = self.config.poll_interval
        last_err = "no answer"
        while True:
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise TimeoutError(last_err)
            try:
                pb = await self.provider.get(machine_id, total=min(remaining, 5.0))
                self.view.provider_latest[machine_id] = pb
                if pb.state in targets or pb.state == S.MACHINE_STATE_FAILED:
                    return pb
                if on_path is not None and pb.state not in on_path:
                    raise _MovedAway(pb)
                last_err = f"still {S.Name(pb.state)}"
            except ProviderError as exc:
                last_err = str(exc)
                if exc.code.name == "NOT_FOUND":
                    raise
            await asyncio.sleep(min(interval, max(0.0, deadline - self.clock())))
            interval = min(interval * 1.5, 1.0)

    async def _watch(self) -> None:
        """While flows wait, List what changed since the last List and hand each waiting flow its record.

        A List that started before a flow registered may show a record older than that flow's own
        ack. That record can only be the transition's start state or newer (never its target),
        unless an earlier flow on the same machine ended while this List was in flight (its end
        was seen in an ack or a Get, not in a List): then the List may be older than that end, and
        a record in the target state is confirmed with one Get instead of trusted.
        """
        backoff = self.config.watch_interval
        while self._waiters:
            # The task ends when nothing waits and the next waiter starts a new one: without this,
            # flows starting and ending all the time made Lists back to back (25/s against 20/s).
            pause = self._watch_list_at + self.config.watch_interval - self.clock()
            if pause > 0:
                await asyncio.sleep(pause)
                continue  # (re-check: the last waiter may have gone meanwhile)
            started = self._watch_list_at = self.clock()
            self._watch_gen += 1
            gen = self._watch_gen
            ended = self._ended_during_list = set()
            full = not self._watch_cursor
            if not full and started - self._watch_last_full >= self.config.watch_full_after:
                # Flows waiting unusually long (a provider that lost its revisions?) get a direct look
                # at their own machines -- a bounded number of Gets -- rather than a full List, which
                # at 10^5 machines stalls the session loop for a tenth of a second or more.
                self._watch_last_full = started
                stale = [(mid, x) for mid, x in self._waiters.items()
                         if started - x.checked >= self.config.watch_full_after and not x.fut.done()]
                stale.sort(key=lambda x: x[1].checked)
                for mid, sw in stale[:64]:
                    sw.checked = started
                    self._spawn_confirm(mid, sw)
            try:
                lst = await self.provider.list(b"" if full else self._watch_cursor, total=30.0)
            except ProviderError as exc:
                log.warning("completion watch List failed; retrying", error=str(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = self.config.watch_interval
            self.watch_lists += 1
            if full:
                self._watch_last_full = started
            self._watch_cursor = bytes(lst.revision)
            waiters = self._waiters
            for pb in lst.machines:
                w = waiters.get(pb.id)
                if w is None or w.fut.done():
                    continue
                st = pb.state
                if st in w.targets or st == S.MACHINE_STATE_FAILED:
                    trusted = w.gen < gen or pb.id not in ended
                elif w.on_path is not None and st not in w.on_path:
                    # Moved away by someone else -- unless this List predates the flow's own call.
                    trusted = w.gen < gen
                else:
                    continue
                if trusted:
                    del waiters[pb.id]
                    w.fut.set_result(pb)
                else:  # the record may predate the flow (or one that ended during this List)
                    self._spawn_confirm(pb.id, w)
            await asyncio.sleep(max(0.0, self.config.watch_interval - (self.clock() - started)))

    def _spawn_confirm(self, machine_id: str, w: _Waiter) -> None:
        async def confirm() -> None:
            self.confirm_gets += 1
            try:
                pb = await self.provider.get(machine_id, total=5.0)
            except ProviderError:
                return  # the next List sees the machine anyway
            if self._waiters.get(machine_id) is w and not w.fut.done() and w.resolves(pb.state):
                del self._waiters[machine_id]
                w.fut.set_result(pb)

        task = asyncio.create_task(confirm(), name=f"confirm-{machine_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _provision(self, machine_id: str, binding: Binding | None) -> None:
        try:
            async with self._step(urgent=False):
                ack = await self.provider.create(machine_id)
            self.view.provider_latest[machine_id] = ack.machine
            if ack.machine.state != S.MACHINE_STATE_IDLE:
                pb = await self._wait_state(machine_id, {S.MACHINE_STATE_IDLE}, self._deadline(),
                                            S.MACHINE_STATE_SPECULATIVE, S.MACHINE_STATE_CREATING)
            else:
                pb = ack.machine
        except ProviderError as exc:
            await self._handle_error("Provision", machine_id, exc, S.MACHINE_STATE_SPECULATIVE)
            return
        except _MovedAway as exc:
            self._adopt("Provision", machine_id, exc.machine, "Create: moved away while waiting")
            return
        except TimeoutError as exc:
            self._fail(machine_id, f"Create: timed out after {self.config.execute_timeout:g}s ({exc})")
            self._outcome("Provision", "timeout")
            return
        if pb.state == S.MACHINE_STATE_FAILED:
            self.view.set(pb)
            self.view.failed_local.add(machine_id)
            self._outcome("Provision", "transition_error")
            return
        # Idle now: configure it for the need it was created for, if that need still exists.
        current = (
            self.resolve_binding(binding.cluster_id, binding.need_fingerprint, binding.priority) if binding else None
        )
        if current is None:
            self.view.set(pb)
            self._outcome("Provision", "success_unbound")
            return
        self._show_configuring(pb, current)
        await self._configure_flow(machine_id, current, kind="Provision", base=pb)

    async def _configure_flow(
        self, machine_id: str, binding: Binding, kind: str = "Bootstrap", base: provider_pb2.Machine | None = None
    ) -> None:
        base = base or self.view.provider_latest.get(machine_id)
        session = self.sessions.get(binding.cluster_id)
        if session is None:
            self._release_to(machine_id, base)
            self._outcome(kind, "no_session")
            return
        started = time.perf_counter()
        try:
            async with self._step(urgent=kind != "Bootstrap", slots=self._bootstrap_slots):
                blob = await session.request_bootstrap(list(binding.requirements), self.config.bootstrap_timeout)
        except BootstrapUnavailable as exc:
            # The provider was not touched: the machine goes back to Idle for a later retry.
            self.bootstrap_failures[(binding.cluster_id, binding.need_fingerprint)] = str(exc)
            self._release_to(machine_id, base)
            self._outcome(kind, "blob_timeout")
            return
        if self.metrics:
            self.metrics.bootstrap_duration.observe(time.perf_counter() - started)
        if blob.error:
            self.bootstrap_failures[(binding.cluster_id, binding.need_fingerprint)] = blob.error
            self._release_to(machine_id, base)
            self._outcome(kind, "blob_error")
            return
        try:
            async with self._step(urgent=True):
                ack = await self.provider.configure(machine_id, binding.cluster_id, blob.user_data, binding.metadata())
            pb = ack.machine
            if pb.state != S.MACHINE_STATE_CONFIGURED:
                pb = await self._wait_state(machine_id, {S.MACHINE_STATE_CONFIGURED}, self._deadline(),
                                            S.MACHINE_STATE_IDLE, S.MACHINE_STATE_CONFIGURING)
        except ProviderError as exc:
            await self._handle_error(kind, machine_id, exc, S.MACHINE_STATE_IDLE, "configure_error")
            return
        except _MovedAway as exc:
            self._adopt(kind, machine_id, exc.machine, "Configure: moved away while waiting")
            return
        except TimeoutError as exc:
            self._fail(machine_id, f"Configure: timed out after {self.config.execute_timeout:g}s ({exc})")
            self._outcome(kind, "timeout")
            return
        if pb.state == S.MACHINE_STATE_CONFIGURED and pb.cluster != binding.cluster_id:
            self._adopt(kind, machine_id, pb, f"Configure: bound to {pb.cluster!r}, not {binding.cluster_id!r}")
            return
        self.view.provider_latest[machine_id] = pb
        self.view.set(pb, force=True)
        if pb.state == S.MACHINE_STATE_FAILED:
            self.view.failed_local.add(machine_id)
            self._outcome(kind, "transition_error")
            return
        self.bootstrap_failures.pop((binding.cluster_id, binding.need_fingerprint), None)
        self._outcome(kind, "success")

    async def _drain_flow(self, machine_id: str, cluster: str, node: str, grace: int, preemptor_priority: int) -> None:
        kind = "Preempt" if preemptor_priority else "Reclaim"
        refused = await self._reclaim_instruction(machine_id, cluster, node, grace, preemptor_priority)
        if refused:
            # The operator did not get the instruction (or neither acked it nor saw its grace run
            # out): the machine stays Configured for its cluster; a later cycle may try again.
            log.info("drain dropped: the cluster's operator has not been told", machine=machine_id,
                        cluster=cluster, node=node, reason=refused)
            self._release_to(machine_id, None)
            self._outcome(kind, refused)
            return
        try:
            async with self._step(urgent=True):
                ack = await self.provider.drain(machine_id, grace)
            pb = ack.machine
            if pb.state != S.MACHINE_STATE_IDLE:
                pb = await self._wait_state(machine_id, {S.MACHINE_STATE_IDLE}, self._deadline(grace),
                                            S.MACHINE_STATE_CONFIGURED, S.MACHINE_STATE_DRAINING)
        except ProviderError as exc:
            await self._handle_error(kind, machine_id, exc, S.MACHINE_STATE_CONFIGURED)
            return
        except _MovedAway as exc:
            self._adopt(kind, machine_id, exc.machine, "Drain: moved away while waiting")
            return
        except TimeoutError as exc:
            self._fail(machine_id, f"Drain: timed out ({exc})")
            self._outcome(kind, "timeout")
            return
        self.view.provider_latest[machine_id] = pb
        self.view.set(pb, force=True)
        if pb.state == S.MACHINE_STATE_FAILED:
            self.view.failed_local.add(machine_id)
        self._outcome(kind, "success" if pb.state == S.MACHINE_STATE_IDLE else "transition_error")

    async def tell_operator(self, machine_id: str, cluster: str, node: str, grace: int,
                            preemptor_priority: int) -> str:
        """The reclaim rule on its own (see _reclaim_instruction), for flows outside the executor."""
        return await self._reclaim_instruction(machine_id, cluster, node, grace, preemptor_priority)

    async def _reclaim_instruction(self, machine_id: str, cluster: str, node: str, grace: int,
                                   preemptor_priority: int) -> str:
        """Tell the cluster's operator; "" when the provider Drain may go ahead, else why not.

        The rule: a machine Configured for a cluster is drained only after that cluster's
        operator received a ReclaimInstruction for it (the frame was written to its stream) and
        either acked it, or the instruction's grace ran out since it was delivered. So: no session
        -> "no_session"; not delivered within ``reclaim_ack_timeout`` (session gone, outbox full,
        stream stuck) -> "reclaim_undelivered" (and the queued frame is withdrawn); delivered but
        neither acked nor past its grace when the ack wait ends -> "reclaim_no_ack".
        """
        session = self.sessions.get(cluster)
        if session is None:
            return "no_session"
        sent: ReclaimSent = session.reclaim([node], grace, preemptor_priority)
        both: set[asyncio.Future[Any]] = {sent.delivered, sent.acked}
        if not sent.was_delivered:
            if not any(f.done() for f in both):  # (both come back cancelled if the send failed)
                await asyncio.wait(both, timeout=self.config.reclaim_ack_timeout, return_when=asyncio.FIRST_COMPLETED)
            if not sent.was_delivered:
                if sent.withdraw():
                    return "reclaim_undelivered"
                # Being written at this very moment: wait for the write to finish (or fail).
                await asyncio.wait(both, timeout=self.config.reclaim_ack_timeout, return_when=asyncio.FIRST_COMPLETED)
                if not sent.was_delivered:
                    return "reclaim_undelivered"
        delivered_at = self.clock()
        if sent.was_acked:
            log.info("reclaim acknowledged", machine=machine_id, node=node, nodes_started=sent.acked.result())
            return ""
        ack_wait = min(self.config.reclaim_ack_timeout, max(1.0, float(grace)))
        if not sent.acked.done():
            await asyncio.wait({sent.acked}, timeout=ack_wait)
        if sent.was_acked:
            log.info("reclaim acknowledged", machine=machine_id, node=node, nodes_started=sent.acked.result())
            return ""
        # No ack: the whole wait ran (>= the grace when the grace fits in it), or the session
        # closed early (then only the time actually waited counts).
        waited = ack_wait if not sent.acked.done() else self.clock() - delivered_at
        if waited >= grace:
            log.info("reclaim delivered, not acked, grace expired; draining", machine=machine_id, node=node,
                     grace=grace)
            return ""
        return "reclaim_no_ack"

    async def _delete_flow(self, machine_id: str) -> None:
        try:
            async with self._step(urgent=False):
                ack = await self.provider.delete(machine_id)
            pb = ack.machine
            if pb.state != S.MACHINE_STATE_SPECULATIVE:
                pb = await self._wait_state(machine_id, {S.MACHINE_STATE_SPECULATIVE}, self._deadline(),
                                            S.MACHINE_STATE_IDLE, S.MACHINE_STATE_DELETING)
        except ProviderError as exc:
            await self._handle_error("Delete", machine_id, exc, S.MACHINE_STATE_IDLE)
            return
        except _MovedAway as exc:
            self._adopt("Delete", machine_id, exc.machine, "Delete: moved away while waiting")
            return
        except TimeoutError as exc:
            self._fail(machine_id, f"Delete: timed out ({exc})")
            self._outcome("Delete", "timeout")
            return
        self.view.provider_latest[machine_id] = pb
        self.view.set(pb, force=True)
        if pb.state == S.MACHINE_STATE_FAILED:
            self.view.failed_local.add(machine_id)
        self._outcome("Delete", "success" if pb.state == S.MACHINE_STATE_SPECULATIVE else "transition_error")

    async def _handle_error(self, kind: str, machine_id: str, exc: ProviderError, expected: int,
                            outcome: str = "transition_error") -> None:
        """A provider error ended the flow. ``expected`` is the state the call needed.

        Fencing: another incarnation owns the machine, touch nothing. No answer at all (the
        provider unreachable or too slow through every retry): FAILED, as a timeout. Any other
        answer: re-read the machine. Gone (NOT_FOUND) -> forget it; a conflict answer
        (ALREADY_EXISTS, ABORTED, NOT_FOUND) or a record no longer in ``expected`` (the provider's
        wrong-state answer is INTERNAL, FAILED_PRECONDITION being reserved for fencing) -> we lost
        a race: show the provider's record, drop the reservation, let the next cycle decide. Only a
        FAILED record, or an error on a machine still in ``expected`` (INTERNAL, INVALID_ARGUMENT,
        ...), or one we cannot re-read after a non-conflict error, ends FAILED.
        """
        if exc.fenced:
            # Another incarnation of this shard owns the machine now: touch nothing, never retry.
            log.error("fenced by provider (zombie shard?)", kind=kind, machine=machine_id, error=str(exc))
            self._outcome(kind, "fenced")
            return
        why = f"{exc.rpc}: {exc.code.name}: {exc.details}"
        if kind == "Provision" and exc.code.name == "RESOURCE_EXHAUSTED":
            await self._out_of_capacity(machine_id, why)
            return
        if exc.no_answer:
            self._fail(machine_id, why)
            self._outcome(kind, outcome)
            return
        try:
            pb = await self.provider.get(machine_id, total=5.0)
        except ProviderError as gexc:
            if gexc.code.name == "NOT_FOUND":
                self._adopt(kind, machine_id, None, why)
                return
            if exc.conflict:
                # The answer itself says someone else holds the machine; the reconcile will show it.
                log.info("lost a race for the machine; re-read failed", kind=kind, machine=machine_id, error=why,
                         reread_error=str(gexc))
                self.view.reserved_for.pop(machine_id, None)
                self._release_to(machine_id, None)
                self._outcome(kind, "conflict_reread")
                return
            self._fail(machine_id, why)
            self._outcome(kind, outcome)
            return
        self.view.provider_latest[machine_id] = pb
        if pb.state == S.MACHINE_STATE_FAILED:
            self.view.set(pb, force=True)
            self.view.failed_local.add(machine_id)
            self._outcome(kind, outcome)
            return
        if exc.conflict or pb.state != expected:
            self._adopt(kind, machine_id, pb, why)
            return
        self._fail(machine_id, why)
        self._outcome(kind, outcome)

    async def _out_of_capacity(self, machine_id: str, why: str) -> None:
        """Create refused RESOURCE_EXHAUSTED through every retry: the provider is out of capacity or
        quota for this slot now. A slot still Speculative there is cooled down, not failed for good
        (a quota error used to burn every slot of the pool within seconds, for the whole leadership
        term); anything else the re-read shows is handled as any other answer."""
        try:
            pb = await self.provider.get(machine_id, total=5.0)
        except ProviderError:
            pb = None
        if pb is not None and pb.state != S.MACHINE_STATE_SPECULATIVE:
            self._adopt("Provision", machine_id, pb, why)
            return
        cool = self.config.capacity_cooldown
        log.warning("provider out of capacity; slot cooled down", machine=machine_id, error=why, seconds=cool)
        self.view.reserved_for.pop(machine_id, None)
        if pb is not None:
            self.view.provider_latest[machine_id] = pb
        self.view.cool_down(machine_id, f"{why} (out of capacity: tried again after {cool:g}s)", self.clock() + cool)
        self._outcome("Provision", "out_of_capacity")

    def _adopt(self, kind: str, machine_id: str, pb: provider_pb2.Machine | None, why: str) -> None:
        """We lost a race for the machine: the provider's record (None: it is gone) replaces ours,
        its reservation is dropped, nothing is FAILED; the next cycle decides what to do with it."""
        log.info("lost a race for the machine; showing the provider's record", kind=kind, machine=machine_id,
                 error=why, state=S.Name(pb.state) if pb is not None else "gone")
        self.view.reserved_for.pop(machine_id, None)
        if pb is None:
            self.view.forget(machine_id)
        else:
            self.view.provider_latest[machine_id] = pb
            if not self.view.set(pb, force=True):
                self.view.forget(machine_id)  # a record the view refuses is not shown (as in reconcile)
        self._outcome(kind, "conflict_reread")


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


def _copy(pb: provider_pb2.Machine) -> provider_pb2.Machine:
    out = provider_pb2.Machine()
    out.CopyFrom(pb)
    return out


def requirements_to_proto(reqs: Sequence[Any]) -> tuple[capacity_pb2.NodeSelectorRequirement, ...]:
    from bigfleet.wire.needs import requirement_to_proto

    return tuple(requirement_to_proto(r) for r in reqs)
