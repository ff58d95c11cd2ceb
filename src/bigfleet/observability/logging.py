"""One place that configures structlog for every daemon.

JSON lines by default (machines read daemon logs); ``console`` for humans at a
terminal. Standard-library logging (grpc, pysyncobj, kubernetes) is routed
through the same renderer so a process never emits two formats.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

import structlog

LogFormat = Literal["json", "console"]


def configure_logging(level: str = "info", fmt: LogFormat = "json", component: str | None = None) -> None:
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        raise ValueError(f"unknown log level {level!r}")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer,
        ])
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(lvl, logging.INFO) if lvl < logging.INFO else lvl)
    if component:
        structlog.contextvars.bind_contextvars(component=component)


def get_logger(name: str | None = None, **bound: Any) -> Any:
    log = structlog.get_logger(name) if name else structlog.get_logger()
    return log.bind(**bound) if bound else log
