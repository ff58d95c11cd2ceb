"""Read-only fleet dashboard: static page plus JSON endpoints, mounted by the shard and the
coordinator on ``--http-listen``. The JSON is built from the same servicer code that answers the
gRPC read APIs, so the page and ``bigfleetctl`` never disagree."""

from bigfleet.dashboard.model import ActionLog, History, Sample, ShortfallAges
from bigfleet.dashboard.server import DashboardServer

__all__ = ["ActionLog", "DashboardServer", "History", "Sample", "ShortfallAges"]
