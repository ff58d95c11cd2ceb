"""Lazy decoding of provider List answers (bigfleet.shard.listing): the same machines and cursor as
parsing the whole MachineList, whatever the field order; bad bytes are a provider error."""

from __future__ import annotations

import grpc
import pytest

from bigfleet.shard.listing import ListedMachines, MalformedList
from bigfleet.shard.provider_client import ProviderError
from bigfleet.v1alpha1 import provider_pb2


def _machines(n: int) -> list[provider_pb2.Machine]:
    out = []
    for i in range(n):
        m = provider_pb2.Machine(id=f"m{i}", state=provider_pb2.MACHINE_STATE_IDLE, instance_type="m5.large",
                                 zone="z", price_per_hour=0.1 * i, labels={"k": str(i)}, last_error="é" * (i % 3))
        m.resources.resources["cpu"] = "2"
        out.append(m)
    return out


def test_same_machines_and_revision_as_a_whole_parse() -> None:
    lst = provider_pb2.MachineList(machines=_machines(300), revision=b"\x00rev\xff")
    got = ListedMachines(lst.SerializeToString())
    assert len(got) == 300 and got.revision == b"\x00rev\xff"
    assert list(got.machines) == list(lst.machines)
    assert list(got.machines) == list(lst.machines)  # iterable again
    # revision before the machines, and fields this reader does not know (a newer provider) skipped
    unknown = b"\x18\x2a" + b"\x21" + b"\x01" * 8 + b"\x2d" + b"\x02" * 4  # field 3 varint, 4 fixed64, 5 fixed32
    raw = provider_pb2.MachineList(revision=b"r").SerializeToString() + unknown + \
        provider_pb2.MachineList(machines=_machines(2)).SerializeToString()
    got = ListedMachines(raw)
    assert got.revision == b"r" and [m.id for m in got.machines] == ["m0", "m1"]
    empty = ListedMachines(b"")
    assert len(empty) == 0 and empty.revision == b"" and list(empty.machines) == []


@pytest.mark.parametrize("raw", [b"\x0a\x05ab", b"\x0a", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0b"])
def test_bad_framing_is_refused(raw: bytes) -> None:
    with pytest.raises(MalformedList):
        ListedMachines(raw)


def test_a_machine_that_does_not_decode_is_a_provider_error() -> None:
    good = provider_pb2.MachineList(machines=_machines(1)).SerializeToString()
    bad = b"\x0a\x02\x0a\xff"  # a Machine whose field 1 claims 255 bytes
    got = ListedMachines(good + bad)
    it = got.machines
    assert next(it).id == "m0"
    with pytest.raises(ProviderError) as ei:
        next(it)
    assert ei.value.code == grpc.StatusCode.INTERNAL
