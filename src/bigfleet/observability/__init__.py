"""Logging and metrics shared by every daemon."""

from bigfleet.observability.logging import configure_logging, get_logger
from bigfleet.observability.metrics import MetricsServer, new_registry, start_metrics_server

__all__ = ["MetricsServer", "configure_logging", "get_logger", "new_registry", "start_metrics_server"]
