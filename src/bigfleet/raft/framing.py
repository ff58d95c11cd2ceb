"""Cheaper framing for pysyncobj's small messages, readable by any pysyncobj peer.

pysyncobj deflates every message it sends (``zlib.compress(data, 3)``). For the ~70-700-byte
AppendEntries and replies of a busy group most of that cost is zlib setting up its 256 KiB of
state, not compressing: 40-80 µs a message, the largest part of a Raft round trip on a loaded
leader. A small message is sent as a *stored* deflate stream with the smallest window and hash
(about 1 µs); it is still a zlib stream, so every peer (ours or a plain pysyncobj) decodes it with
``zlib.decompress``. Large messages (snapshots, catch-up batches) are compressed as before.
"""

from __future__ import annotations

import zlib as _zlib

#: below this many bytes a message is not worth compressing
SMALL = 4096


def compress(data: bytes, level: int = -1) -> bytes:
    if len(data) >= SMALL:
        return _zlib.compress(data, level)
    c = _zlib.compressobj(0, _zlib.DEFLATED, 9, 1)
    return c.compress(data) + c.flush()


decompress = _zlib.decompress
error = _zlib.error


def install() -> None:
    """Make pysyncobj's connections use this module in place of zlib (idempotent)."""
    import sys

    from pysyncobj import tcp_connection

    tcp_connection.zlib = sys.modules[__name__]
