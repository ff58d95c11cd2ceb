"""One pool across providers: the shard's provider seam, and the router in front of several.

A shard draws from one provider (``--provider HOST:PORT``, ids as the provider gives them) or from
several (``--provider NAME=HOST:PORT``, repeatable). With several, :class:`ProviderRouter` is the
one component that knows: it names every machine ``NAME/<provider's id>`` on the way in (so two
providers may use the same ids) and routes each call by that prefix on the way out -- a Create to
the provider that listed the Speculative slot (the one that offers its type and market), Get,
Configure, Drain and Delete to the one that holds the machine. The rest of the shard sees one
provider with one pool, priced together by the engine.

Per provider, not per shard: the fencing sequence (each member has its own client and counter;
all carry the shard's epoch, so any member's fencing answer still steps the whole replica down);
the List cursor and the reconcile scope (``sources()``: a full List from one provider forgets
only machines under its own prefix, and one provider down leaves the other's machines as last
read); and the ownership mode (``NAME=HOST:PORT@shared`` overrides ``--ownership`` for one
provider's machines, e.g. own racks exclusive to this shard, a cloud account shared by many).
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from bigfleet.shard.provider_client import ProviderClient, ProviderError
from bigfleet.v1alpha1 import provider_pb2

#: between a provider's name and its own machine id in the ids the shard uses
SEPARATOR = "/"
OWNERSHIP_MODES = ("exclusive", "shared")
_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")
_CURSOR_MAGIC = b"bfmp1:"


class ListSource(Protocol):
    """One provider's inventory as the reconciler reads it: its own cursor, its own scope."""

    @property
    def name(self) -> str: ...

    @property
    def prefix(self) -> str:
        """Ids this source answers for start with this ("" = every id)."""
        ...

    async def list(self, since_revision: bytes = b"", total: float | None = None) -> provider_pb2.MachineList: ...


class ShardProvider(Protocol):
    """What the shard calls (executor, reconciler, retirer, handoff): one provider or a router."""

    target: str
    extra_metadata: dict[str, str]

    async def create(self, machine_id: str) -> provider_pb2.TransitionAck: ...

    async def configure(self, machine_id: str, cluster_id: str, blob: bytes,
                        metadata: dict[str, str]) -> provider_pb2.TransitionAck: ...

    async def drain(self, machine_id: str, grace_period_seconds: int) -> provider_pb2.TransitionAck: ...

    async def delete(self, machine_id: str) -> provider_pb2.TransitionAck: ...

    async def get(self, machine_id: str, total: float | None = None) -> provider_pb2.Machine: ...

    async def list(self, since_revision: bytes = b"", total: float | None = None) -> provider_pb2.MachineList: ...

    def sources(self) -> Sequence[ListSource]: ...

    def ownership_for(self, machine_id: str) -> str | None:
        """The ownership mode for this machine's provider (None: the shard's ``--ownership``)."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class ProviderSpec:
    """One ``--provider`` value: ``HOST:PORT`` (name "") or ``NAME=HOST:PORT[@exclusive|@shared]``."""

    name: str
    target: str
    ownership: str | None = None


def _check_target(target: str, text: str) -> None:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"provider {text!r}: expected HOST:PORT, got {target!r}")


def parse_provider_specs(text: str | Sequence[str]) -> tuple[ProviderSpec, ...]:
    """The shard's providers from ``--provider`` values (one string may hold several, comma-separated).

    Raises ValueError with the offending value: a malformed address, a bad or repeated name, an
    unknown ownership mode, or an unnamed provider next to others (ids could not be routed).
    """
    items = [text] if isinstance(text, str) else list(text)
    parts = [p.strip() for item in items for p in item.split(",") if p.strip()]
    specs: list[ProviderSpec] = []
    for part in parts:
        name, eq, rest = part.partition("=")
        if not eq:
            name, rest = "", part
        elif not _NAME.match(name):
            raise ValueError(f"provider {part!r}: the name must be 1-32 lowercase letters, digits or '-' "
                             "(it prefixes the provider's machine ids)")
        target, at, mode = rest.partition("@")
        if at and mode not in OWNERSHIP_MODES:
            raise ValueError(f"provider {part!r}: ownership after '@' must be exclusive or shared, got {mode!r}")
        if at and not name:
            raise ValueError(f"provider {part!r}: a per-provider ownership needs a name (NAME=HOST:PORT@{mode})")
        _check_target(target, part)
        specs.append(ProviderSpec(name, target, mode or None))
    if len(specs) > 1 and any(not s.name for s in specs):
        raise ValueError("several providers need a name each: --provider NAME=HOST:PORT (repeatable)")
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"provider name {dup[0]!r} is given twice")
    return tuple(specs)


class _Member:
    """One provider behind the router: its client, and its machines' prefix in the shard's ids."""

    def __init__(self, name: str, client: ProviderClient, ownership: str | None) -> None:
        self.name = name
        self.prefix = name + SEPARATOR
        self.client = client
        self.ownership = ownership

    def tag(self, pb: provider_pb2.Machine) -> provider_pb2.Machine:
        pb.id = self.prefix + pb.id
        return pb

    def tag_ack(self, ack: provider_pb2.TransitionAck) -> provider_pb2.TransitionAck:
        if ack.HasField("machine"):
            self.tag(ack.machine)
        return ack

    async def list(self, since_revision: bytes = b"", total: float | None = None) -> provider_pb2.MachineList:
        lst = await self.client.list(since_revision, total)
        for pb in lst.machines:
            pb.id = self.prefix + pb.id
        return lst


def _encode_cursor(cursors: dict[str, bytes]) -> bytes:
    return _CURSOR_MAGIC + json.dumps({k: base64.b64encode(v).decode() for k, v in sorted(cursors.items())},
                                      separators=(",", ":")).encode()


def _decode_cursor(raw: bytes) -> dict[str, bytes]:
    """A cursor this router wrote; anything else reads as "no cursor" (a full List from every member)."""
    if not raw.startswith(_CURSOR_MAGIC):
        return {}
    try:
        data = json.loads(raw[len(_CURSOR_MAGIC):])
        return {str(k): base64.b64decode(str(v)) for k, v in dict(data).items()}
    except (ValueError, TypeError):
        return {}


class ProviderRouter:
    """Several providers as one (see the module docstring); implements :class:`ShardProvider`."""

    def __init__(self, members: Sequence[tuple[ProviderSpec, ProviderClient]]) -> None:
        if not members:
            raise ValueError("a provider router needs at least one provider")
        self._members = [_Member(spec.name, client, spec.ownership) for spec, client in members]
        self._by_name = {m.name: m for m in self._members}
        self.target = ",".join(f"{spec.name}={spec.target}" for spec, _ in members)
        self._extra: dict[str, str] = {}

    @property
    def extra_metadata(self) -> dict[str, str]:
        return self._extra

    @extra_metadata.setter
    def extra_metadata(self, value: dict[str, str]) -> None:
        self._extra = value
        for m in self._members:
            m.client.extra_metadata = value

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self._members)

    def member(self, name: str) -> ProviderClient:
        return self._by_name[name].client

    def _route(self, rpc: str, machine_id: str) -> tuple[_Member, str]:
        name, sep, inner = machine_id.partition(SEPARATOR)
        m = self._by_name.get(name) if sep else None
        if m is None or not inner:
            # NOT_FOUND: no provider of this shard holds such a machine (the executor re-reads, never retries).
            raise ProviderError(rpc, grpc.StatusCode.NOT_FOUND,
                                f"machine {machine_id!r} names none of this shard's providers {list(self._by_name)}")
        return m, inner

    async def create(self, machine_id: str) -> provider_pb2.TransitionAck:
        m, inner = self._route("Create", machine_id)
        return m.tag_ack(await m.client.create(inner))

    async def configure(self, machine_id: str, cluster_id: str, blob: bytes,
                        metadata: dict[str, str]) -> provider_pb2.TransitionAck:
        m, inner = self._route("Configure", machine_id)
        return m.tag_ack(await m.client.configure(inner, cluster_id, blob, metadata))

    async def drain(self, machine_id: str, grace_period_seconds: int) -> provider_pb2.TransitionAck:
        m, inner = self._route("Drain", machine_id)
        return m.tag_ack(await m.client.drain(inner, grace_period_seconds))

    async def delete(self, machine_id: str) -> provider_pb2.TransitionAck:
        m, inner = self._route("Delete", machine_id)
        return m.tag_ack(await m.client.delete(inner))

    async def get(self, machine_id: str, total: float | None = None) -> provider_pb2.Machine:
        m, inner = self._route("Get", machine_id)
        return m.tag(await m.client.get(inner, total))

    async def list(self, since_revision: bytes = b"", total: float | None = None) -> provider_pb2.MachineList:
        """Every member's changes in one list (the completion watch): a member that does not answer
        keeps its cursor and is asked again next time; only all of them failing is an error."""
        cursors = _decode_cursor(since_revision) if since_revision else {}
        results = await asyncio.gather(*(m.list(cursors.get(m.name, b""), total) for m in self._members),
                                       return_exceptions=True)
        out = provider_pb2.MachineList()
        errors: list[BaseException] = []
        for m, res in zip(self._members, results, strict=True):
            if isinstance(res, BaseException):
                errors.append(res)
                continue
            out.machines.extend(res.machines)
            cursors[m.name] = bytes(res.revision)
        for e in errors:
            if not isinstance(e, ProviderError):
                raise e
        if len(errors) == len(self._members):
            raise errors[0]
        out.revision = _encode_cursor(cursors)
        return out

    def sources(self) -> Sequence[ListSource]:
        return self._members

    def ownership_for(self, machine_id: str) -> str | None:
        name, sep, _ = machine_id.partition(SEPARATOR)
        m = self._by_name.get(name) if sep else None
        return m.ownership if m is not None else None

    async def close(self) -> None:
        await asyncio.gather(*(m.client.close() for m in self._members), return_exceptions=True)


def build_provider(specs: Sequence[ProviderSpec], client: Callable[[str], ProviderClient]) -> ShardProvider:
    """The one place a shard's provider is assembled: one unnamed provider is used as it is (ids
    unchanged, as before routing existed); named ones go behind a :class:`ProviderRouter`."""
    if not specs:
        raise ValueError("a shard needs a provider: --provider HOST:PORT or --provider NAME=HOST:PORT")
    if len(specs) == 1 and not specs[0].name:
        return client(specs[0].target)
    return ProviderRouter([(s, client(s.target)) for s in specs])
