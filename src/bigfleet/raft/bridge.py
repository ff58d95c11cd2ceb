"""One Raft member driven from asyncio.

pysyncobj's ticks run on the daemon's event loop (raft/looptick.py): its sockets are the loop's
readers and writers, and a replicated call's outcome is a callback on the loop itself, which the
bridge turns into an awaitable result. Every wait is bounded by a timeout (a lost callback becomes
a :class:`RaftError`, which callers answer by retrying an idempotent command). Measured at 500
changed roll-ups/s on a 3-replica shard: pysyncobj's own tick thread and the loop took the GIL from
each other on every message, which doubled a commit's p50 (docs/perf/shard-ha.md, session 12).
"""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

from pysyncobj import FAIL_REASON

from bigfleet.raft import dns, framing
from bigfleet.raft.consumer import LockedConsumer
from bigfleet.raft.errors import RaftError, fail_reason
from bigfleet.raft.looptick import LoopDriver
from bigfleet.raft.pipelined import PipelinedSyncObj
from bigfleet.raft.settings import RaftSettings, RaftSettingsError, sync_obj_conf

framing.install()

S = TypeVar("S")
T = TypeVar("T")


class RaftBridge(Generic[S]):
    """Role, status, reads, writes and membership for one member; construct on the loop's thread."""

    journal_file: ClassVar[str] = "raft.journal"
    dump_file: ClassVar[str] = "raft.dump"

    def __init__(self, cfg: RaftSettings, consumer: LockedConsumer[S]) -> None:
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self._repl = consumer
        conf = sync_obj_conf(cfg, self.journal_file, self.dump_file)
        ensure_unused(cfg.bind_address or cfg.self_address)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("a Raft member is built inside the event loop that drives it") from None
        self._loop = loop
        self._loop_thread = threading.get_ident()
        dns.install(_host(a) for a in [cfg.self_address, *cfg.other_peers()])
        conf.autoTick = False
        # (heartbeats can lapse for a fraction of an election timeout before anyone notices)
        self._driver = LoopDriver(loop, cfg.tick_period, max(2 * cfg.tick_period, min(0.25, cfg.election_min / 4)))
        self._obj = PipelinedSyncObj(cfg.self_address, cfg.other_peers(), conf, consumers=[consumer],
                                     poller=self._driver.poller)
        self._self_address = cfg.self_address
        self._driver.start(self._obj.doTick)

    @property
    def stall_ticks(self) -> int:
        """Ticks the stall watcher ran because the event loop was busy."""
        return self._driver.rescued

    # ------------------------------------------------------------- status
    @property
    def address(self) -> str:
        return self._self_address

    def is_leader(self) -> bool:
        return bool(self._obj._isLeader())

    def leader(self) -> str | None:
        node = self._obj._getLeader()
        return None if node is None else str(getattr(node, "address", node))

    def raft_term(self) -> int:
        return int(self._obj.raftCurrentTerm)

    def last_applied(self) -> int:
        return int(self._obj.raftLastApplied)

    def has_quorum(self) -> bool:
        return bool(self._obj.hasQuorum)

    def status(self) -> dict[str, Any]:
        with self._driver.lock:  # (the stall watcher may be ticking: pysyncobj's sets must not move)
            return dict(self._obj.getStatus())

    def members(self) -> list[str]:
        with self._driver.lock:
            others = [str(n.address) for n in self._obj.otherNodes]
        return sorted([self._self_address, *others])

    # -------------------------------------------------------------- reads
    def read(self, fn: Callable[[S], T]) -> T:
        """Run ``fn`` on the local state under the apply lock (keep it short)."""
        with self._repl.lock:
            return fn(self._repl.fsm)

    # ------------------------------------------------------------- writes
    async def call(self, method: Callable[..., Any], *args: Any, timeout: float, what: str = "raft write") -> Any:
        """Invoke a pysyncobj callback-style method and await its committed result (the callback
        comes from a tick, on this loop)."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def settle(res: Any, err: Any) -> None:
            if fut.done():
                return
            if err == FAIL_REASON.SUCCESS:
                fut.set_result(res)
            else:
                fut.set_exception(RaftError(f"{what} failed: {fail_reason(err)}"))

        def done(res: Any, err: Any) -> None:
            if threading.get_ident() == self._loop_thread:
                settle(res, err)
                return
            try:  # (a tick of the stall watcher's)
                self._loop.call_soon_threadsafe(settle, res, err)
            except RuntimeError:  # the loop closed while the write was in flight: nobody waits
                pass

        method(*args, callback=done)
        self._driver.wake()
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError as exc:
            raise RaftError(f"{what} timed out after {timeout}s") from exc

    async def add_node(self, address: str, timeout: float = 10.0) -> None:
        await self.call(self._obj.addNodeToCluster, address, timeout=timeout, what="membership change")

    async def remove_node(self, address: str, timeout: float = 10.0) -> None:
        await self.call(self._obj.removeNodeFromCluster, address, timeout=timeout, what="membership change")

    def destroy(self) -> None:
        self._driver.stop(self._obj.destroy)


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def ensure_unused(address: str) -> None:
    """Refuse a Raft address another process already listens on. pysyncobj binds in its own thread
    and only logs a failure, so such a member ran outside any group while looking healthy."""
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return  # (sync_obj_conf's checks and pysyncobj report other malformed addresses)
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError:
        return  # (an unresolvable name: pysyncobj's own error stands)
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as pysyncobj binds: TIME_WAIT is fine)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise RaftSettingsError([f"Raft address {address} is already in use by another process"]) from None
