"""`decide()`: one deterministic decision cycle (normalise → Phase 1 → Phase 2 → Phase 3 → ledgers).

The engine lives one module per phase; this module keeps the names it always exported:

* `normalise` — fold gangs that fit on one machine;       * `order` — precedence order, the passes;
* `credit` — bound supply and in-flight reservations;      * `same_domain` — a gang's domain;
* `acquire` — Idle then Speculative, strict spread;        * `preempt` — Phase 2 victims;
* `reclaim`, `release` — Phase 3;                          * `verdicts`, `ledgers` — what is reported;
* `cycle` — the sequence of phases and the caching `Engine`.
"""

from __future__ import annotations

from .cycle import Engine, decide, decide_indexed
from .normalise import normalize
from .same_domain import DomainBucket, choose_same_bucket

__all__ = ["DomainBucket", "Engine", "choose_same_bucket", "decide", "decide_indexed", "normalize"]
