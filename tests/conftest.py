"""Session-wide test set-up shared by every area."""

from __future__ import annotations

from grpc._cython import cygrpc

# gRPC's asyncio engine shuts itself down (joining its poller thread) when the last
# aio channel or server object is garbage-collected. If a call of an earlier test is
# still pending on the completion queue at that moment, the join never returns, and
# because collection can happen anywhere, an unrelated later test hangs. Holding one
# reference for the whole session keeps the engine up, as it is in a daemon process.
cygrpc.init_grpc_aio()
