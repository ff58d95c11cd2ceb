"""pysyncobj's SyncObj adjusted for unbatched appends driven from an event loop.

* **A follower's next index never moves back on a success reply.** With unbatched appends the
  leader keeps several AppendEntries in flight per follower and advances the follower's next index
  as it sends. pysyncobj 0.3.17 sets it from every success reply, so a late reply for an older
  append moved it *back*: the leader re-sent entries the follower had already applied, and the
  follower truncated and re-appended them, logging CRITICAL "truncating already-applied log entries"
  (bakwc/PySyncObj#167). Raft's rule is nextIndex = max(nextIndex, matchIndex + 1) on success.
* **No AppendEntries only to carry a new commit index.** pysyncobj sends one to every follower
  after each local apply; followers learn the index from the next append or heartbeat anyway, and
  under load it doubled the group's messages and replies.
* **A group of one commits at once.** Its commit waited for the next tick; a command appended in
  a group without peers now asks for that tick straight away.
* **The poller can be given** (the event loop's, raft/looptick.py) instead of pysyncobj's own.
"""

from __future__ import annotations

from typing import Any

from pysyncobj import SyncObj


class PipelinedSyncObj(SyncObj):  # type: ignore[misc]
    def __init__(self, *args: Any, poller: Any = None, **kwargs: Any) -> None:
        # (before pysyncobj's __init__, which builds its own poller and records which attributes
        # are its own, so none of these ends up in a snapshot)
        self.__dict__["_poller_given"] = poller
        super().__init__(*args, **kwargs)

    @property
    def _poller(self) -> Any:
        return self.__dict__["_poller_used"]

    @_poller.setter
    def _poller(self, value: Any) -> None:
        # pysyncobj assigns a poll() poller of its own in __init__; a given one (the event loop's) wins
        self.__dict__["_poller_used"] = self.__dict__.get("_poller_given") or value

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

    def _SyncObj__applyLogEntries(self) -> bool:
        super()._SyncObj__applyLogEntries()
        return False  # (True made the tick send every follower an AppendEntries for the commit index)

    def _checkCommandsToApply(self) -> None:
        before = self._SyncObj__getCurrentLogIndex()
        super()._checkCommandsToApply()
        if not self._SyncObj__otherNodes and self._SyncObj__getCurrentLogIndex() != before:
            notifier = getattr(self, "_SyncObj__pipeNotifier", None)
            if notifier is not None:
                notifier.notify()
