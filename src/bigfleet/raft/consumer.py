"""A pysyncobj consumer whose state machine is read and replaced under one lock.

Replicated commands run on pysyncobj's tick thread while the daemon reads from its event loop, and
a snapshot install (``_deserialize``) swaps the whole state machine; one re-entrant lock makes each
of those atomic with respect to the others.
"""

from __future__ import annotations

import threading
from typing import Any, Generic, TypeVar

from pysyncobj import SyncObjConsumer

S = TypeVar("S")


class LockedConsumer(SyncObjConsumer, Generic[S]):  # type: ignore[misc]
    """Subclasses add their ``@replicated`` commands and take ``self.lock`` around ``self.fsm``."""

    def __init__(self, fsm: S) -> None:
        # pysyncobj snapshots only attributes created after its __init__: the lock stays local.
        self.lock = threading.RLock()
        super().__init__()
        self.fsm = fsm

    def _deserialize(self, data: dict[str, Any]) -> None:
        with self.lock:
            super()._deserialize(data)
