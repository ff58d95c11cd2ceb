"""Per-session outbound queue that coalesces frames and never blocks its producers.

The cycle and the executor push frames for many sessions; a slow operator must
not slow them down. Frames carrying a ``supersedes_key`` replace an older
queued frame with the same key (the newer one moves to the back, so the
operator still sees state changes in order). Frames without a key are kept
in order up to a bound; past it the outbox reports overflow and the session
is closed, the operator reconnects and gets a full resync.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict

from bigfleet.v1alpha1 import shard_pb2


def supersedes_key(msg: shard_pb2.ShardMessage) -> str | None:
    kind = msg.WhichOneof("payload")
    if kind == "node_state_update":
        return msg.node_state_update.supersedes_key or None
    if kind == "available_capacity":
        return msg.available_capacity.supersedes_key or None
    return None


class OutboxOverflow(Exception):
    pass


class Outbox:
    def __init__(self, max_unkeyed: int = 4096) -> None:
        self._frames: OrderedDict[object, shard_pb2.ShardMessage] = OrderedDict()
        self._unkeyed = 0
        self._max_unkeyed = max_unkeyed
        self._seq = itertools.count()
        self._event = asyncio.Event()
        self.closed = False
        self.coalesced = 0

    def __len__(self) -> int:
        return len(self._frames)

    def put(self, msg: shard_pb2.ShardMessage) -> None:
        """Queue ``msg`` without waiting; raises OutboxOverflow when unkeyed frames pile up."""
        if self.closed:
            return
        key = supersedes_key(msg)
        if key is not None:
            k: object = ("k", key)
            if k in self._frames:
                del self._frames[k]
                self.coalesced += 1
            self._frames[k] = msg
        else:
            if self._unkeyed >= self._max_unkeyed:
                raise OutboxOverflow(f"{self._unkeyed} unkeyed frames queued")
            self._unkeyed += 1
            self._frames[("u", next(self._seq))] = msg
        self._event.set()

    def pop_ready(self) -> list[shard_pb2.ShardMessage]:
        """Take everything queued, in order."""
        out = list(self._frames.values())
        self._frames.clear()
        self._unkeyed = 0
        self._event.clear()
        return out

    async def wait(self) -> None:
        await self._event.wait()

    def close(self) -> None:
        self.closed = True
        self._event.set()
