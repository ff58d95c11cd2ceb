"""pysyncobj's SyncObj with a follower's next index that never moves back on a success reply.

With unbatched appends the leader keeps several AppendEntries in flight per follower and advances
the follower's next index as it sends. pysyncobj 0.3.17 sets the next index from every success reply,
so a late reply for an older append moves it *back* and the leader re-sends entries the follower has
already appended and often applied. The follower then truncates and re-appends them, logging CRITICAL
"truncating already-applied log entries ... state machine may have diverged" (the entries are the
same, so nothing diverges, but the warning is false and the re-sends cost CPU on all three replicas;
bakwc/PySyncObj#167 describes the same non-monotonic index). Raft's rule is nextIndex =
max(nextIndex, matchIndex + 1) on success; failure and reset replies keep pysyncobj's handling.
"""

from __future__ import annotations

from typing import Any

from pysyncobj import SyncObj


class PipelinedSyncObj(SyncObj):  # type: ignore[misc]
    # pysyncobj registers ``self.__onMessageReceived`` (mangled to this name) with its transport in
    # ``__init__``; overriding the mangled name is the only hook it offers.
    def _SyncObj__onMessageReceived(self, node: Any, message: Any) -> None:
        if not (isinstance(message, dict) and message.get("type") == "next_node_idx"
                and message.get("success") and not message.get("reset")):
            super()._SyncObj__onMessageReceived(node, message)
            return
        next_index: dict[Any, int] = self._SyncObj__raftNextIndex
        sent_up_to = next_index.get(node)
        super()._SyncObj__onMessageReceived(node, message)
        if sent_up_to is not None and next_index.get(node, sent_up_to) < sent_up_to:
            next_index[node] = sent_up_to
