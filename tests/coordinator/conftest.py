"""Shared fixtures for the coordinator tests."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """Daemon `main()`s run in-process elsewhere in the session configure structlog and the
    root logger with the sys.stderr of *their* test (a capture file pytest closes afterwards).
    Start every test from structlog's defaults, which resolve the stream at each call."""
    structlog.reset_defaults()
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers[:] = [logging.StreamHandler()]
    yield
    root.handlers[:] = saved
