"""Node registration: an UpcomingNode is Ready only once its Node registered and is Ready.

The shard reports a machine Configured when the provider finished configuring it; that says nothing
about the kubelet. The operator watches Nodes and matches each Configured machine to its Node by
name (``NodeStateUpdate.node_name``) or by ``spec.providerID`` (``provider_id``):

* no Node yet: the UpcomingNode is ``Joining``;
* a Node that is not Ready: ``Registered``;
* a Ready Node: ``Ready``.

A machine that stays Configured without a Node for ``--node-registration-timeout`` (default 15 min,
measured from ``status.configuredTime`` so a restarted operator keeps the clock), or whose Node
registered but is still not Ready ``--node-ready-timeout`` after it was configured (default 30 min:
a kubelet that joined but never gets its network or CSI up serves nothing either), is reported to the
shard (``NodeRegistrationTimeout``), which marks it FAILED and provisions a replacement, and gets a
``RegistrationTimeout`` Event. Reports repeat (every ``report_every``) until the shard's FAILED frame
arrives, so a report lost with a session is sent again.

Pure parts (``node_ready``, ``NodeIndex``, ``due_timeouts``) take their inputs; the operator wires
them to its informers.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

PHASE_JOINING = "Joining"
PHASE_REGISTERED = "Registered"
PHASE_READY = "Ready"
NODE_READINESS_MODES = ("auto", "node", "provider")


def node_ready(node: Mapping[str, Any]) -> bool:
    for c in ((node.get("status") or {}).get("conditions") or []):
        if isinstance(c, Mapping) and c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def node_name_of(node: Mapping[str, Any]) -> str:
    return str((node.get("metadata") or {}).get("name") or "")


class NodeIndex:
    """Nodes by name and by ``spec.providerID``, kept from an informer's change callbacks."""

    def __init__(self) -> None:
        self.by_name: dict[str, Mapping[str, Any]] = {}
        self.by_provider_id: dict[str, str] = {}

    def apply(self, kind: str, node: Mapping[str, Any]) -> str:
        """An informer event; returns the node's name ("" for a SYNCED marker)."""
        name = node_name_of(node)
        if not name:
            return ""
        old = self.by_name.get(name)
        if old is not None:
            pid = str((old.get("spec") or {}).get("providerID") or "")
            if pid and self.by_provider_id.get(pid) == name:
                del self.by_provider_id[pid]
        if kind == "DELETED":
            self.by_name.pop(name, None)
            return name
        self.by_name[name] = node
        pid = str((node.get("spec") or {}).get("providerID") or "")
        if pid:
            self.by_provider_id[pid] = name
        return name

    def find(self, node_name: str, provider_id: str = "") -> Mapping[str, Any] | None:
        n = self.by_name.get(node_name) if node_name else None
        if n is None and provider_id:
            name = self.by_provider_id.get(provider_id)
            n = self.by_name.get(name) if name else None
        return n

    def phase(self, node_name: str, provider_id: str = "") -> str:
        """The UpcomingNode phase of a Configured machine with this node name / provider id."""
        n = self.find(node_name, provider_id)
        if n is None:
            return PHASE_JOINING
        return PHASE_READY if node_ready(n) else PHASE_REGISTERED


def parse_time(text: str) -> float | None:
    try:
        return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Timeout:
    """A Configured machine whose Node did not register, or did not become Ready, in time."""

    upcoming_name: str
    machine_id: str
    node_name: str
    waited_seconds: int
    registered: bool = False  # the Node registered but never became Ready


def due_timeouts(upcoming: Iterable[Mapping[str, Any]], index: NodeIndex, timeout: float, now: float,
                 ready_timeout: float = 0.0) -> list[Timeout]:
    """UpcomingNodes ``Joining`` for longer than ``timeout`` seconds whose Node is still absent, and
    (``ready_timeout`` > 0) ``Registered`` ones configured longer than ``ready_timeout`` ago whose
    Node is still not Ready."""
    out = []
    for obj in upcoming:
        st = obj.get("status") or {}
        phase = st.get("phase")
        if phase not in (PHASE_JOINING, PHASE_REGISTERED) or not st.get("machineID"):
            continue
        limit = timeout if phase == PHASE_JOINING else ready_timeout
        since = parse_time(str(st.get("configuredTime") or ""))
        if limit <= 0 or since is None or now - since < limit:
            continue
        node = str(((st.get("nodeRef") or {}).get("name")) or "")
        found = index.find(node, str(st.get("providerID") or ""))
        if phase == PHASE_JOINING and found is not None:
            continue  # registered meanwhile; the next frame or Node event moves the phase on
        if phase == PHASE_REGISTERED and (found is None or node_ready(found)):
            continue  # Ready (or gone) meanwhile: the phase moves on with the Node event
        out.append(Timeout(str((obj.get("metadata") or {}).get("name") or ""), str(st["machineID"]),
                           node or node_name_of(found or {}), int(now - since), phase == PHASE_REGISTERED))
    return out


def parse_duration(text: str) -> float:
    """Seconds from ``900``, ``900s``, ``15m``, ``1h``, ``1.5h``; raises ValueError."""
    t = text.strip().lower()
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    mult = 1.0
    if t and t[-1] in units:
        mult, t = units[t[-1]], t[:-1]
    value = float(t) * mult
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"bad duration {text!r}")
    return value
