"""The AWS EC2 backend on the provider kit's seam: substrate actions only, the kit does the contract.

- ``describe``: the supply model (configured pools and reservations as
  SPECULATIVE slots, priced and shaped) plus, on a fresh start, the instances
  this provider already runs (adopted IDLE by their ``bigfleet:machine-id``
  tag). Also the periodic refresh (``--reconcile-interval``): spot prices,
  interruption signals (instance state and tags, the optional SQS queue).
- ``create_instance``: look the operation's instance up by its operation tag,
  else RunInstances with a ClientToken derived from the operation; wait for
  ``running``.
- ``configure_instance``: tag the cluster binding, deliver the bootstrap blob
  over SSM SendCommand and run the AMI's bootstrap hook.
- ``drain_instance``: run the AMI's drain hook over SSM, remove the binding tags.
- ``delete_instance``: TerminateInstances; the slot becomes SPECULATIVE again.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from bigfleet.observability import get_logger
from bigfleet.provider.kit import (
    Backend,
    CapacityType,
    ConfigureCall,
    CreateCall,
    CreateResult,
    DeleteCall,
    DrainCall,
    HostRef,
    Instance,
    State,
)
from bigfleet_provider_aws import states
from bigfleet_provider_aws.aws import (
    TAG_CAPACITY,
    TAG_CLUSTER,
    TAG_INTERRUPTION,
    TAG_MACHINE,
    TAG_OPERATION,
    TAG_PROVIDER,
    TAG_RELEASED,
    Api,
    SsmError,
    error_code,
    metadata_tags,
    tags_of,
)
from bigfleet_provider_aws.config import Config

T = TypeVar("T")
_EPOCH = datetime.fromtimestamp(0, UTC)

LABEL_PREFIX = "bigfleet.aws/"
TERMINAL_COMMAND = {"Success", "Cancelled", "TimedOut", "Failed", "Cancelling", "DeliveryTimedOut",
                    "ExecutionTimedOut", "Undeliverable", "Terminated", "InvalidPlatform", "AccessDenied"}


@dataclass(frozen=True)
class Slot:
    id: str
    instance_type: str
    zone: str
    capacity: CapacityType  # as reported (BARE_METAL for on-demand .metal)
    spot: bool
    reservation: str = ""
    reserved_price: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)


def build_slots(cfg: Config, seed_count: int | None = None) -> list[Slot]:
    """The speculative pool: pools (types x zones x markets) then reservations; ids are deterministic.

    ``seed_count`` (tests, conformance) replaces the per-pool slot counts with
    that many slots spread round-robin over every pool combination.
    """
    combos: list[tuple[str, str, CapacityType, dict[str, str], int]] = []
    for p in cfg.pools:
        for market in p.capacity_types:
            for t in p.instance_types:
                for z in p.zones:
                    combos.append((t, z, market, p.labels, p.slots))
    counts = [c[4] for c in combos]
    if seed_count is not None and combos:
        counts = [seed_count // len(combos) + (1 if i < seed_count % len(combos) else 0) for i in range(len(combos))]
    out: list[Slot] = []
    taken: dict[tuple[str, str, CapacityType], int] = {}
    for (t, z, market, labels, _), n in zip(combos, counts, strict=True):
        cap = states.capacity_type(market, t)
        for _ in range(n):
            i = taken.get((t, z, cap), 0)
            taken[(t, z, cap)] = i + 1
            out.append(Slot(states.slot_id(cfg.provider_name, cap, t, z, i), t, z, cap,
                            market == CapacityType.SPOT, labels=dict(labels)))
    for r in cfg.reserved:
        for _ in range(r.count):
            i = taken.get((r.instance_type, r.zone, CapacityType.RESERVED), 0)
            taken[(r.instance_type, r.zone, CapacityType.RESERVED)] = i + 1
            out.append(Slot(states.slot_id(cfg.provider_name, CapacityType.RESERVED, r.instance_type, r.zone, i),
                            r.instance_type, r.zone, CapacityType.RESERVED, False, r.capacity_reservation_id,
                            r.price_per_hour, dict(r.labels)))
    return out


def shell_quote(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def bootstrap_scripts(blob: bytes, cluster: str, op_id: str, hook: str, chunk_chars: int,
                      state_dir: str = "/var/lib/bigfleet") -> list[str]:
    """Shell scripts that reassemble the blob on the host, check it and run the bootstrap hook.

    The blob goes base64-encoded in chunks of ``chunk_chars`` (one SendCommand
    each), is checked against its SHA-256 and is readable by root only; the hook
    gets the cluster id and the blob's path.
    """
    b64 = base64.b64encode(blob).decode()
    digest = hashlib.sha256(blob).hexdigest()
    tag = hashlib.sha256(op_id.encode()).hexdigest()[:16]
    d = shell_quote(state_dir)
    part = f"{d}/bootstrap-{tag}.b64"
    final = f"{d}/bootstrap.blob"
    head = f"set -eu; umask 077; mkdir -p {d}; "
    chunks = [b64[i:i + chunk_chars] for i in range(0, len(b64), chunk_chars)] or [""]
    scripts = []
    for n, c in enumerate(chunks):
        redirect = ">" if n == 0 else ">>"
        scripts.append(f"{head}printf %s {shell_quote(c)} {redirect} {part}")
    cluster_b64 = base64.b64encode(cluster.encode()).decode()
    scripts[-1] += (f"; base64 -d {part} > {final}.tmp; "
                    f"echo \"{digest}  \"{final}.tmp | sha256sum -c --status -; "
                    f"mv {final}.tmp {final}; rm -f {part}; "
                    f"exec {shell_quote(hook)} \"$(printf %s {cluster_b64} | base64 -d)\" {final}")
    return scripts


class AwsBackend(Backend):
    def __init__(self, cfg: Config, api: Api, seed_count: int | None = None,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self.cfg = cfg
        self.api = api
        self.metrics = api.metrics
        self.log = get_logger("bigfleet.provider.aws")
        self.slots = build_slots(cfg, seed_count)
        self.by_id = {s.id: s for s in self.slots}
        self.pool = executor or ThreadPoolExecutor(max_workers=cfg.api.max_pool_connections,
                                                   thread_name_prefix="aws")
        self.host_provider = f"{cfg.provider_name}-{cfg.region}"
        self.types: dict[str, dict[str, Any]] = {}
        self.spot: dict[tuple[str, str], float] = {}
        self._spot_at = -1e18
        self.marks: dict[str, states.Mark] = {}
        self._seen_marks: set[tuple[str, str]] = set()

    async def _io(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, lambda: fn(*args, **kw))

    # ---- supply --------------------------------------------------------------------------------

    async def _refresh_types(self) -> None:
        missing = [t for t in self.cfg.instance_types if t not in self.types]
        if missing:
            got = await self._io(self.api.instance_types, missing)
            unknown = sorted(set(missing) - set(got))
            if unknown:
                raise RuntimeError(f"DescribeInstanceTypes does not know {unknown} in {self.cfg.region}")
            self.types.update(got)

    async def _refresh_spot(self) -> None:
        spot_pairs = {(s.instance_type, s.zone) for s in self.slots if s.spot}
        if not spot_pairs or time.monotonic() - self._spot_at < self.cfg.pricing.spot_refresh_seconds:
            return
        try:
            prices = await self._io(self.api.spot_prices, sorted({t for t, _ in spot_pairs}),
                                    {z for _, z in spot_pairs})
        except Exception as exc:
            self.metrics.spot_refresh.labels("error").inc()
            self.log.warning("spot price refresh failed; keeping the previous prices", error=error_code(exc))
            return
        self.spot.update(prices)
        self._spot_at = time.monotonic()
        self.metrics.spot_refresh.labels("ok").inc()
        missing = sorted(f"{t}/{z}" for t, z in spot_pairs - set(prices))
        if missing:
            self.log.warning("no spot price history; priced at a fraction of on-demand", pools=missing[:20],
                             fraction=self.cfg.pricing.spot_fallback_fraction)

    def price(self, slot: Slot) -> float:
        if slot.capacity == CapacityType.RESERVED:
            return slot.reserved_price
        od = self.cfg.pricing.on_demand.get(slot.instance_type, 0.0)
        if slot.spot:
            p = self.spot.get((slot.instance_type, slot.zone))
            return p if p is not None else od * self.cfg.pricing.spot_fallback_fraction
        return od

    def probability(self, slot: Slot) -> float:
        if not slot.spot:
            return 0.0
        p = self.cfg.interruption.forecast(slot.instance_type, slot.zone)
        mark = self.marks.get(slot.id)
        return max(p, mark.probability) if mark else p

    def _labels(self, slot: Slot) -> dict[str, str]:
        labels = {
            "node.kubernetes.io/instance-type": slot.instance_type,
            "topology.kubernetes.io/zone": slot.zone,
            "topology.kubernetes.io/region": self.cfg.region,
            f"{LABEL_PREFIX}capacity-type": states.CAPACITY_TAG[slot.capacity] if not slot.spot else "spot",
            **slot.labels,
        }
        if states.is_metal(slot.instance_type):
            labels[f"{LABEL_PREFIX}bare-metal"] = "true"
        mark = self.marks.get(slot.id)
        if mark is not None:
            labels[f"{LABEL_PREFIX}interruption"] = mark.kind
        return labels

    def _shape(self, instance_type: str) -> tuple[dict[str, str], dict[str, str]]:
        info = self.types.get(instance_type)
        if info is None:
            return {}, {}
        return states.allocatable(info, self.cfg.system_reserve)

    async def _observe(self) -> dict[str, dict[str, Any]]:
        """Scan this provider's instances; derive interruption marks; fold in queued SQS notices."""
        instances = await self._io(self.api.managed_instances)
        newest: dict[str, dict[str, Any]] = {}

        def rank(i: dict[str, Any]) -> tuple[bool, Any, str]:
            # The slot's current instance: a live one first (at most one per slot), else the latest launched.
            return (i.get("State", {}).get("Name") in states.ALIVE, i.get("LaunchTime") or _EPOCH, i["InstanceId"])

        for inst in instances:
            mid = tags_of(inst).get(TAG_MACHINE, "")
            if not mid:
                continue
            cur = newest.get(mid)
            if cur is None or rank(inst) > rank(cur):
                newest[mid] = inst
        if self.cfg.interruption.sqs_queue_url:
            await self._drain_queue(newest)
        marks: dict[str, states.Mark] = {}
        for mid, inst in newest.items():
            if inst.get("InstanceLifecycle") != "spot":
                continue
            tags = tags_of(inst)
            mark = states.interruption_mark(
                inst.get("State", {}).get("Name", ""), (inst.get("StateReason") or {}).get("Code", ""),
                tags.get(TAG_INTERRUPTION, ""), self.cfg.interruption.notice_probability,
                self.cfg.interruption.rebalance_probability, released=TAG_RELEASED in tags)
            if mark is not None:
                marks[mid] = mark
                key = (inst["InstanceId"], mark.kind)
                if key not in self._seen_marks:
                    self._seen_marks.add(key)
                    self.metrics.interruptions.labels(mark.kind).inc()
                    self.log.warning("spot interruption signal", machine=mid, instance=inst["InstanceId"],
                                     kind=mark.kind)
        self.marks = marks
        return newest

    async def _drain_queue(self, newest: dict[str, dict[str, Any]]) -> None:
        """EventBridge -> SQS notices become a durable tag on the instance, then leave the queue."""
        url = self.cfg.interruption.sqs_queue_url
        try:
            notices = await self._io(self.api.receive_notices, url)
        except Exception as exc:
            self.log.warning("reading the interruption queue failed", error=error_code(exc))
            return
        by_instance = {inst["InstanceId"]: inst for inst in newest.values()}
        for iid, kind, receipt in notices:
            value = {"EC2 Spot Instance Interruption Warning": "warning",
                     "EC2 Instance Rebalance Recommendation": "rebalance"}.get(kind)
            inst = by_instance.get(iid)
            try:
                if value and inst is not None:
                    current = tags_of(inst).get(TAG_INTERRUPTION, "")
                    if not (current == "warning" and value == "rebalance"):
                        await self._io(self.api.tag, iid, {TAG_INTERRUPTION: value})
                        inst.setdefault("Tags", []).append({"Key": TAG_INTERRUPTION, "Value": value})
                await self._io(self.api.delete_notice, url, receipt)
            except Exception as exc:
                self.log.warning("handling an interruption notice failed", instance=iid, error=error_code(exc))

    async def describe(self) -> list[Instance]:
        await self._refresh_types()
        await self._refresh_spot()
        newest = await self._observe()
        out: list[Instance] = []
        for slot in self.slots:
            resources, alloc = self._shape(slot.instance_type)
            inst = Instance(
                id=slot.id, instance_type=slot.instance_type, zone=slot.zone, capacity_type=slot.capacity,
                price_per_hour=self.price(slot), interruption_probability=self.probability(slot),
                resources=resources, allocatable=alloc, labels=self._labels(slot), state=State.SPECULATIVE,
            )
            live = newest.get(slot.id)
            if live is not None and live.get("State", {}).get("Name") in (states.PENDING, states.RUNNING):
                # Only read on a fresh start (the kit never changes a known machine's state or host):
                # an instance this provider already runs comes back IDLE instead of being launched twice.
                inst.host = HostRef(self.host_provider, live["InstanceId"])
                inst.state = State.IDLE
            out.append(inst)
        return out

    # ---- lifecycle -----------------------------------------------------------------------------

    def _slot_for(self, call_machine: Any) -> Slot:
        slot = self.by_id.get(call_machine.id)
        if slot is not None:
            return slot
        # A machine the config no longer lists (or a conformance fault slot): launch what the record says.
        cap = call_machine.capacity_type
        return Slot(call_machine.id, call_machine.instance_type, call_machine.zone, cap, cap == CapacityType.SPOT)

    async def create_instance(self, call: CreateCall) -> CreateResult:
        m = call.machine
        slot = self._slot_for(m)
        await self._refresh_types()  # after a restart on a state file, Create may come before any Describe
        token = states.client_token(self.cfg.provider_name, m.id, call.operation_id)
        inst = await self._io(self.api.find_by_operation, token)
        if inst is not None:
            self.metrics.adopted.inc()
            self.log.info("create found its instance by operation tag", machine=m.id, instance=inst["InstanceId"])
        else:
            inst = await self._launch(slot, token, call.operation_id)
        iid = inst["InstanceId"]
        try:
            await self._wait_running(iid, inst)
        except asyncio.CancelledError:
            # Timed out (or the provider stops): do not leave a host nobody will ever use.
            self.pool.submit(self._terminate_quietly, iid)
            raise
        resources, alloc = self._shape(slot.instance_type)
        return CreateResult(HostRef(self.host_provider, iid), resources or None, alloc or None)

    def _terminate_quietly(self, iid: str) -> None:
        try:
            self.api.terminate(iid)
            self.log.warning("terminated the instance of an abandoned create", instance=iid)
        except Exception as exc:
            self.log.warning("could not terminate the instance of an abandoned create", instance=iid,
                             error=error_code(exc))

    async def _launch(self, slot: Slot, token: str, op_id: str) -> dict[str, Any]:
        tags = {
            "Name": slot.id, TAG_PROVIDER: self.cfg.provider_name, TAG_MACHINE: slot.id, TAG_OPERATION: token,
            TAG_CAPACITY: "spot" if slot.spot else states.CAPACITY_TAG[slot.capacity], **self.cfg.launch.tags,
        }
        attempt = 0
        while True:
            try:
                inst = await self._io(self.api.run_instance, instance_type=slot.instance_type, zone=slot.zone,
                                      token=token, tags=tags, spot=slot.spot, reservation_id=slot.reservation)
                self.metrics.launched.labels("spot" if slot.spot else states.CAPACITY_TAG[slot.capacity]).inc()
                self.log.info("launched instance", machine=slot.id, instance=inst["InstanceId"],
                              instance_type=slot.instance_type, zone=slot.zone, spot=slot.spot, operation_id=op_id)
                return inst
            except Exception as exc:
                code = error_code(exc)
                # botocore already retried throttling and 5xx; a connection-level failure may still have
                # launched the instance, so look it up by its operation tag before trying again.
                transient = code in ("EndpointConnectionError", "ReadTimeoutError", "ConnectTimeoutError",
                                     "ConnectionClosedError", "InternalError", "ServiceUnavailable",
                                     "RequestLimitExceeded", "Unavailable")
                attempt += 1
                if not transient or attempt >= 5:
                    raise RuntimeError(f"RunInstances {slot.instance_type} in {slot.zone}: {code}: "
                                       f"{_message(exc)}") from None
                await asyncio.sleep(min(30.0, self.cfg.api.poll_seconds * 2 ** attempt))
                found = await self._io(self.api.find_by_operation, token)
                if found is not None:
                    self.metrics.adopted.inc()
                    return found

    async def _wait_running(self, iid: str, inst: dict[str, Any] | None) -> None:
        missing = 0
        while True:
            if inst is None:
                missing += 1
                if missing > 30:
                    raise RuntimeError(f"instance {iid} is not visible to DescribeInstances")
            else:
                outcome, why = states.create_outcome(inst.get("State", {}).get("Name", ""),
                                                     (inst.get("StateReason") or {}).get("Message", ""))
                if outcome == states.Outcome.READY:
                    return
                if outcome == states.Outcome.FAILED:
                    raise RuntimeError(f"instance {iid}: {why}")
            await asyncio.sleep(self.cfg.api.poll_seconds)
            inst = await self._io(self.api.describe_instance, iid)

    async def _ssm(self, iid: str, script: str, comment: str, timeout: int) -> None:
        deadline = time.monotonic() + self.cfg.bootstrap.wait_for_ssm_seconds
        while True:
            try:
                cid = await self._io(self.api.send_command, iid, script, comment, timeout)
                break
            except SsmError as exc:
                # Right after boot the SSM agent has not registered yet.
                if exc.code != "InvalidInstanceId" or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(self.cfg.api.poll_seconds)
        self.log.debug("ssm command sent", command_id=cid, instance=iid, comment=comment, script_bytes=len(script))
        while True:
            status, details = await self._io(self.api.command_status, cid, iid)
            if status == "Success":
                return
            if status in TERMINAL_COMMAND:
                raise RuntimeError(f"ssm command {cid} ({comment}) on {iid}: {status} {details}".rstrip())
            await asyncio.sleep(self.cfg.api.poll_seconds)

    async def configure_instance(self, call: ConfigureCall) -> None:
        iid = call.machine.host.ref
        if not iid:
            raise RuntimeError(f"machine {call.machine.id} has no host")
        await self._io(self.api.tag, iid, {TAG_CLUSTER: call.cluster_id[:256], **metadata_tags(call.shard_metadata)})
        b = self.cfg.bootstrap
        for n, script in enumerate(bootstrap_scripts(call.bootstrap_blob, call.cluster_id, call.operation_id,
                                                     b.hook, b.chunk_chars)):
            await self._ssm(iid, script, f"bigfleet configure {call.operation_id} part {n + 1}", 900)
        self.log.info("configured", machine=call.machine.id, instance=iid, cluster=call.cluster_id,
                      blob_bytes=len(call.bootstrap_blob))

    async def drain_instance(self, call: DrainCall) -> None:
        iid = call.machine.host.ref
        if not iid:
            raise RuntimeError(f"machine {call.machine.id} has no host")
        grace = max(0, int(call.grace_period_seconds))
        script = f"set -eu; exec {shell_quote(self.cfg.bootstrap.drain_hook)} {grace}"
        await self._ssm(iid, script, f"bigfleet drain {call.operation_id}", grace + 120)
        await self._io(self.api.untag, iid, [TAG_CLUSTER, *metadata_tags(call.machine.shard_metadata)])

    async def delete_instance(self, call: DeleteCall) -> None:
        iid = call.machine.host.ref
        if not iid:
            return  # nothing was ever launched for this slot
        try:
            # Marks the end as ours, so it is never read as a spot interruption (even after a restart).
            await self._io(self.api.tag, iid, {TAG_RELEASED: "true"})
        except Exception as exc:  # best effort: without it, only a later AWS-side end could be misread
            self.log.warning("could not tag a released instance", instance=iid, error=error_code(exc))
        state = await self._io(self.api.terminate, iid)
        while state not in states.GONE:
            await asyncio.sleep(self.cfg.api.poll_seconds)
            inst = await self._io(self.api.describe_instance, iid)
            state = "terminated" if inst is None else inst.get("State", {}).get("Name", "")
        self.marks.pop(call.machine.id, None)
        self.log.info("terminated", machine=call.machine.id, instance=iid)


def _message(exc: BaseException) -> str:
    import botocore.exceptions

    if isinstance(exc, botocore.exceptions.ClientError):
        return str(exc.response.get("Error", {}).get("Message", ""))[:300]
    return str(exc)[:300]
