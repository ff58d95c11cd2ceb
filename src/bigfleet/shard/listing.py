"""A provider ``List`` answer read from its wire bytes, one ``Machine`` at a time.

Parsed as one message, a ``MachineList`` of 500 000 machines is ~1.5 GB of upb objects alive at
once (each parsed ``Machine`` costs ~2.5-3 KB against ~300 B on the wire), on top of everything the
shard already holds: the start-up peak of a 500 000-machine shard. The wire format of
``MachineList`` is simple (``repeated Machine machines = 1; bytes revision = 2;``), so the shard
keeps the bytes, indexes where each machine starts and ends, and parses a machine only when the
caller reaches it. Peak: the bytes (~150 MB at 500 000) plus one machine.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from google.protobuf.message import DecodeError
from grpc import StatusCode

from bigfleet.v1alpha1 import provider_pb2

_MACHINES, _REVISION = 1, 2


class MalformedList(ValueError):
    """The bytes are not a valid ``MachineList``."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    n = len(buf)
    while True:
        if pos >= n:
            raise MalformedList("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise MalformedList("varint too long")


class ListedMachines:
    """What the shard reads of a List answer: ``revision`` and ``machines`` (each iteration parses
    the machines afresh, in wire order; `MalformedList` for a machine that does not decode)."""

    __slots__ = ("_bounds", "_raw", "revision")

    def __init__(self, raw: bytes) -> None:
        self._raw = raw
        self._bounds = array("Q")  # start, end of each machine's bytes
        self.revision = b""
        pos, n = 0, len(raw)
        bounds = self._bounds
        while pos < n:
            key, pos = _varint(raw, pos)
            field, wire = key >> 3, key & 7
            if wire == 2:
                size, pos = _varint(raw, pos)
                end = pos + size
                if end > n:
                    raise MalformedList("length past the end")
                if field == _MACHINES:
                    bounds.append(pos)
                    bounds.append(end)
                elif field == _REVISION:
                    self.revision = raw[pos:end]
                pos = end
            elif wire == 0:
                _, pos = _varint(raw, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            else:
                raise MalformedList(f"unsupported wire type {wire}")
            if pos > n:
                raise MalformedList("field past the end")

    def __len__(self) -> int:
        return len(self._bounds) // 2

    @property
    def machines(self) -> Iterator[provider_pb2.Machine]:
        raw, bounds = self._raw, self._bounds
        parse = provider_pb2.Machine.FromString
        for i in range(0, len(bounds), 2):
            try:
                yield parse(raw[bounds[i]:bounds[i + 1]])
            except DecodeError as exc:
                from bigfleet.shard.provider_client import ProviderError

                raise ProviderError("List", StatusCode.INTERNAL, f"undecodable machine {i // 2}: {exc}") from None

    @classmethod
    def of(cls, lst: provider_pb2.MachineList) -> ListedMachines:
        """From an already parsed answer (in-process stubs in tests)."""
        return cls(lst.SerializeToString())
