"""An asyncio event loop on a virtual clock: sleeps and timeouts cost no wall time.

The simulator runs the shard's real asyncio code (executor flows, provider
client retries, session bootstrap waits) on this loop. Nothing does real
I/O, so whenever no callback is ready the loop jumps its clock straight to
the next timer: the same seed and inputs always give the same interleaving.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any


class VirtualClockDeadlock(RuntimeError):
    """Nothing ready and no timer pending: every task waits for something that will never happen."""


class _JumpingSelector(selectors.SelectSelector):
    def __init__(self, loop: VirtualLoop) -> None:
        super().__init__()
        self._vloop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise VirtualClockDeadlock("virtual loop has nothing ready and no timer pending")
        if timeout > 0:
            self._vloop.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        super().__init__(selector=_JumpingSelector(self))

    def time(self) -> float:
        return self.now
