"""The provider's configuration file (``--config FILE``, YAML): supply model, launch template, pricing.

Unknown keys are errors (a typo must not silently change the supply), and every
problem is reported with its path in the file, e.g. ``supply.pools[0].zones``.
Relative file names (the price table, user data) resolve against the config
file's directory.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bigfleet.provider.kit import CapacityType

CAPACITY_NAMES = {
    "on-demand": CapacityType.ON_DEMAND, "on_demand": CapacityType.ON_DEMAND, "ondemand": CapacityType.ON_DEMAND,
    "spot": CapacityType.SPOT,
}
_QTY = re.compile(r"(\d+(\.\d*)?|\.\d+)([kMGTPE]i?|m)?")
_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,40}")


class ConfigError(ValueError):
    """The configuration file is unusable; the message names the offending key."""


@dataclass(frozen=True)
class Pool:
    """instance types × zones × capacity types, ``slots`` SPECULATIVE machines per combination."""

    instance_types: tuple[str, ...]
    zones: tuple[str, ...]
    capacity_types: tuple[CapacityType, ...]
    slots: int
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Reserved:
    """Slots backed by a capacity reservation: RESERVED, priced at what using them costs (default 0)."""

    instance_type: str
    zone: str
    count: int
    price_per_hour: float = 0.0
    capacity_reservation_id: str = ""
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Launch:
    image_id: str
    subnets: dict[str, str] = field(default_factory=dict)
    security_group_ids: tuple[str, ...] = ()
    iam_instance_profile: str = ""
    key_name: str = ""
    user_data: bytes = b""
    tags: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SystemReserve:
    """Subtracted from DescribeInstanceTypes' capacity to get allocatable (kubelet/system reserve)."""

    cpu_millis: int = 100
    memory_mib: int = 512
    cpu_percent: float = 0.0
    memory_percent: float = 0.0
    # "eni" = the VPC CNI formula (ENIs x (IPv4 per ENI - 1) + 2); an integer = that many pods.
    max_pods: int | None = None


@dataclass(frozen=True)
class Pricing:
    on_demand: dict[str, float]
    spot_refresh_seconds: float = 300.0
    # A spot pool without a price history is priced at this fraction of on-demand (never 0).
    spot_fallback_fraction: float = 0.35


@dataclass(frozen=True)
class Interruption:
    default_probability: float = 0.05
    instance_types: dict[str, float] = field(default_factory=dict)
    pools: dict[str, float] = field(default_factory=dict)  # "type/zone"
    notice_probability: float = 0.99
    rebalance_probability: float = 0.5
    sqs_queue_url: str = ""

    def forecast(self, instance_type: str, zone: str) -> float:
        p = self.pools.get(f"{instance_type}/{zone}")
        if p is None:
            p = self.instance_types.get(instance_type, self.default_probability)
        return p


@dataclass(frozen=True)
class Bootstrap:
    ssm_document: str = "AWS-RunShellScript"
    hook: str = "/opt/bigfleet/bootstrap"
    drain_hook: str = "/opt/bigfleet/drain"
    # Base64 characters of the blob per SendCommand; larger blobs go in several commands.
    chunk_chars: int = 32768
    # How long Configure waits for the instance to register with SSM before it gives up.
    wait_for_ssm_seconds: float = 300.0


@dataclass(frozen=True)
class Api:
    retry_mode: str = "adaptive"
    max_attempts: int = 10
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    max_pool_connections: int = 32
    # Seconds between DescribeInstances / GetCommandInvocation polls while a transition waits.
    poll_seconds: float = 5.0


@dataclass(frozen=True)
class Config:
    provider_name: str
    region: str
    endpoint_url: str
    emulator_credentials: bool
    launch: Launch
    pools: tuple[Pool, ...]
    reserved: tuple[Reserved, ...]
    system_reserve: SystemReserve
    pricing: Pricing
    interruption: Interruption
    bootstrap: Bootstrap
    api: Api
    source: str = ""

    @property
    def instance_types(self) -> list[str]:
        seen: dict[str, None] = {}
        for p in self.pools:
            for t in p.instance_types:
                seen[t] = None
        for r in self.reserved:
            seen[r.instance_type] = None
        return list(seen)


# ---- parsing -------------------------------------------------------------------------------------


def _map(v: Any, where: str, allowed: set[str] | None = None) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(v).__name__}")
    if allowed is not None:
        unknown = sorted(set(map(str, v)) - allowed)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(allowed)}")
    return v


def _str(v: Any, where: str, default: str = "", required: bool = False) -> str:
    if v is None:
        if required:
            raise ConfigError(f"{where}: required")
        return default
    if not isinstance(v, str):
        raise ConfigError(f"{where}: expected a string, got {v!r}")
    if required and not v:
        raise ConfigError(f"{where}: must not be empty")
    return v


def _strs(v: Any, where: str, required: bool = False) -> tuple[str, ...]:
    if v is None:
        v = []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise ConfigError(f"{where}: expected a list of non-empty strings")
    if required and not v:
        raise ConfigError(f"{where}: must list at least one")
    return tuple(dict.fromkeys(v))


def _num(v: Any, where: str, default: float, lo: float | None = None, hi: float | None = None) -> float:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{where}: expected a number, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ConfigError(f"{where}: {v} is outside [{lo}, {hi}]")
    return float(v)


def _int(v: Any, where: str, default: int, lo: int = 0) -> int:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(f"{where}: expected an integer >= {lo}, got {v!r}")
    return int(v)


def _labels(v: Any, where: str) -> dict[str, str]:
    m = _map(v, where)
    out = {}
    for k, x in m.items():
        if not isinstance(k, str) or not k or not isinstance(x, (str, int, float, bool)):
            raise ConfigError(f"{where}: labels are string keys with scalar values")
        out[k] = str(x).lower() if isinstance(x, bool) else str(x)
    return out


def parse_cpu_millis(q: str, where: str) -> int:
    m = _QTY.fullmatch(str(q))
    if not m or m.group(3) not in (None, "m"):
        raise ConfigError(f"{where}: {q!r} is not a CPU quantity (e.g. 100m, 0.5, 1)")
    n = float(m.group(1))
    return round(n if m.group(3) == "m" else n * 1000)


def parse_memory_mib(q: str, where: str) -> int:
    m = _QTY.fullmatch(str(q))
    if not m:
        raise ConfigError(f"{where}: {q!r} is not a memory quantity (e.g. 512Mi, 1Gi)")
    n = float(m.group(1))
    unit = m.group(3) or ""
    scale = {"": 1 / (1 << 20), "Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1 << 20,
             "k": 1000 / (1 << 20), "M": 1e6 / (1 << 20), "G": 1e9 / (1 << 20), "T": 1e12 / (1 << 20)}
    if unit not in scale:
        raise ConfigError(f"{where}: unsupported memory unit in {q!r}")
    return math.ceil(n * scale[unit])


def _capacity(v: Any, where: str) -> tuple[CapacityType, ...]:
    names = _strs(v if v is not None else ["on-demand"], where, required=True)
    out = []
    for n in names:
        ct = CAPACITY_NAMES.get(n.lower())
        if ct is None:
            raise ConfigError(f"{where}: unknown capacity type {n!r} (on-demand or spot; reserved capacity "
                              "goes in supply.reserved)")
        out.append(ct)
    return tuple(dict.fromkeys(out))


def load_price_table(path: Path, region: str) -> dict[str, float]:
    """``{region: {instance_type: usd_per_hour}}`` or a flat ``{instance_type: usd_per_hour}``."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"pricing.on_demand_file: cannot read {path}: {exc}") from None
    data = _map(data, f"{path}")
    if data and all(isinstance(v, dict) for v in data.values()):
        if region not in data:
            raise ConfigError(f"{path}: no prices for region {region!r} (regions: {sorted(data)})")
        data = data[region]
    out = {}
    for k, v in data.items():
        out[str(k)] = _num(v, f"{path}: {k}", 0.0, lo=0.0)
    return out


def load_config(path: str | Path, region: str = "", endpoint_url: str = "") -> Config:
    """Read and validate the config; ``region``/``endpoint_url`` (the flags) win over the file."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {p}: {exc}") from None
    return parse_config(raw or {}, p.parent, region, endpoint_url, source=str(p))


def parse_config(raw: Any, base: Path, region: str = "", endpoint_url: str = "", source: str = "") -> Config:
    top = _map(raw, "config", {"provider_name", "region", "endpoint_url", "emulator_credentials", "launch",
                               "supply", "system_reserve", "pricing", "interruption", "bootstrap", "api"})
    name = _str(top.get("provider_name"), "provider_name", "aws")
    if not _NAME.fullmatch(name):
        raise ConfigError("provider_name: lower-case letters, digits and '-', at most 41 characters")
    region = region or _str(top.get("region"), "region")
    if not region:
        raise ConfigError("region: required (in the file or --region)")
    endpoint_url = endpoint_url or _str(top.get("endpoint_url"), "endpoint_url")
    emulator = top.get("emulator_credentials", False)
    if not isinstance(emulator, bool):
        raise ConfigError("emulator_credentials: expected true or false")
    if emulator and not endpoint_url:
        raise ConfigError("emulator_credentials: only with an endpoint_url (a local EC2-compatible emulator)")

    la = _map(top.get("launch"), "launch", {"image_id", "subnets", "security_group_ids", "iam_instance_profile",
                                            "key_name", "user_data_file", "tags"})
    user_data = b""
    udf = _str(la.get("user_data_file"), "launch.user_data_file")
    if udf:
        try:
            user_data = (base / udf).read_bytes()
        except OSError as exc:
            raise ConfigError(f"launch.user_data_file: {exc}") from None
    tags = _labels(la.get("tags"), "launch.tags")
    if any(k.startswith(("bigfleet:", "aws:")) for k in tags):
        raise ConfigError("launch.tags: keys starting with 'bigfleet:' or 'aws:' are reserved")
    launch = Launch(
        image_id=_str(la.get("image_id"), "launch.image_id", required=True),
        subnets={str(k): str(v) for k, v in _map(la.get("subnets"), "launch.subnets").items()},
        security_group_ids=_strs(la.get("security_group_ids"), "launch.security_group_ids"),
        iam_instance_profile=_str(la.get("iam_instance_profile"), "launch.iam_instance_profile"),
        key_name=_str(la.get("key_name"), "launch.key_name"),
        user_data=user_data, tags=tags,
    )

    sup = _map(top.get("supply"), "supply", {"pools", "reserved"})
    pools = []
    for i, pr in enumerate(sup.get("pools") or []):
        w = f"supply.pools[{i}]"
        d = _map(pr, w, {"instance_types", "zones", "capacity_types", "slots", "labels"})
        pools.append(Pool(
            instance_types=_strs(d.get("instance_types"), f"{w}.instance_types", required=True),
            zones=_strs(d.get("zones"), f"{w}.zones", required=True),
            capacity_types=_capacity(d.get("capacity_types"), f"{w}.capacity_types"),
            slots=_int(d.get("slots"), f"{w}.slots", 1),
            labels=_labels(d.get("labels"), f"{w}.labels"),
        ))
    reserved = []
    for i, rr in enumerate(sup.get("reserved") or []):
        w = f"supply.reserved[{i}]"
        d = _map(rr, w, {"instance_type", "zone", "count", "price_per_hour", "capacity_reservation_id", "labels"})
        reserved.append(Reserved(
            instance_type=_str(d.get("instance_type"), f"{w}.instance_type", required=True),
            zone=_str(d.get("zone"), f"{w}.zone", required=True),
            count=_int(d.get("count"), f"{w}.count", 1),
            price_per_hour=_num(d.get("price_per_hour"), f"{w}.price_per_hour", 0.0, lo=0.0),
            capacity_reservation_id=_str(d.get("capacity_reservation_id"), f"{w}.capacity_reservation_id"),
            labels=_labels(d.get("labels"), f"{w}.labels"),
        ))
    if not pools and not reserved:
        raise ConfigError("supply: configure at least one pool or reserved entry")

    sr = _map(top.get("system_reserve"), "system_reserve",
              {"cpu", "memory", "cpu_percent", "memory_percent", "max_pods"})
    max_pods_raw = sr.get("max_pods", "eni")
    max_pods = None if max_pods_raw == "eni" else _int(max_pods_raw, "system_reserve.max_pods", 110, lo=1)
    reserve = SystemReserve(
        cpu_millis=parse_cpu_millis(str(sr.get("cpu", "100m")), "system_reserve.cpu"),
        memory_mib=parse_memory_mib(str(sr.get("memory", "512Mi")), "system_reserve.memory"),
        cpu_percent=_num(sr.get("cpu_percent"), "system_reserve.cpu_percent", 0.0, 0.0, 90.0),
        memory_percent=_num(sr.get("memory_percent"), "system_reserve.memory_percent", 0.0, 0.0, 90.0),
        max_pods=max_pods,
    )

    pc = _map(top.get("pricing"), "pricing", {"on_demand_file", "on_demand", "spot_refresh_seconds",
                                              "spot_fallback_fraction"})
    table: dict[str, float] = {}
    odf = _str(pc.get("on_demand_file"), "pricing.on_demand_file")
    if odf:
        table.update(load_price_table(base / odf, region))
    for k, v in _map(pc.get("on_demand"), "pricing.on_demand").items():
        table[str(k)] = _num(v, f"pricing.on_demand.{k}", 0.0, lo=0.0)
    pricing = Pricing(
        on_demand=table,
        spot_refresh_seconds=_num(pc.get("spot_refresh_seconds"), "pricing.spot_refresh_seconds", 300.0, lo=0.0),
        spot_fallback_fraction=_num(pc.get("spot_fallback_fraction"), "pricing.spot_fallback_fraction", 0.35,
                                    lo=0.0, hi=1.0),
    )
    missing = sorted({t for p in pools for t in p.instance_types} - set(table))
    if missing:
        raise ConfigError(f"pricing: no on-demand price for {missing} (add them to the price table; spot pools "
                          "fall back to a fraction of it)")

    ic = _map(top.get("interruption"), "interruption", {"default_probability", "instance_types", "pools",
                                                        "notice_probability", "rebalance_probability",
                                                        "sqs_queue_url"})
    prob = {"lo": 0.0, "hi": 1.0}
    interruption = Interruption(
        default_probability=_num(ic.get("default_probability"), "interruption.default_probability", 0.05, **prob),
        instance_types={str(k): _num(v, f"interruption.instance_types.{k}", 0.0, **prob)
                        for k, v in _map(ic.get("instance_types"), "interruption.instance_types").items()},
        pools={str(k): _num(v, f"interruption.pools.{k}", 0.0, **prob)
               for k, v in _map(ic.get("pools"), "interruption.pools").items()},
        notice_probability=_num(ic.get("notice_probability"), "interruption.notice_probability", 0.99, **prob),
        rebalance_probability=_num(ic.get("rebalance_probability"), "interruption.rebalance_probability", 0.5,
                                   **prob),
        sqs_queue_url=_str(ic.get("sqs_queue_url"), "interruption.sqs_queue_url"),
    )
    for p in pools:
        if CapacityType.SPOT in p.capacity_types:
            for t in p.instance_types:
                for z in p.zones:
                    if interruption.forecast(t, z) <= 0:
                        raise ConfigError(f"interruption: spot pool {t}/{z} has probability 0; spot machines "
                                          "must declare a probability > 0")

    bc = _map(top.get("bootstrap"), "bootstrap", {"ssm_document", "hook", "drain_hook", "chunk_chars",
                                                  "wait_for_ssm_seconds"})
    bootstrap = Bootstrap(
        ssm_document=_str(bc.get("ssm_document"), "bootstrap.ssm_document", "AWS-RunShellScript"),
        hook=_str(bc.get("hook"), "bootstrap.hook", "/opt/bigfleet/bootstrap"),
        drain_hook=_str(bc.get("drain_hook"), "bootstrap.drain_hook", "/opt/bigfleet/drain"),
        chunk_chars=_int(bc.get("chunk_chars"), "bootstrap.chunk_chars", 32768, lo=1024),
        wait_for_ssm_seconds=_num(bc.get("wait_for_ssm_seconds"), "bootstrap.wait_for_ssm_seconds", 300.0, lo=0.0),
    )

    ac = _map(top.get("api"), "api", {"retry_mode", "max_attempts", "connect_timeout", "read_timeout",
                                      "max_pool_connections", "poll_seconds"})
    mode = _str(ac.get("retry_mode"), "api.retry_mode", "adaptive")
    if mode not in ("legacy", "standard", "adaptive"):
        raise ConfigError("api.retry_mode: legacy, standard or adaptive")
    api = Api(
        retry_mode=mode,
        max_attempts=_int(ac.get("max_attempts"), "api.max_attempts", 10, lo=1),
        connect_timeout=_num(ac.get("connect_timeout"), "api.connect_timeout", 5.0, lo=0.1),
        read_timeout=_num(ac.get("read_timeout"), "api.read_timeout", 30.0, lo=0.1),
        max_pool_connections=_int(ac.get("max_pool_connections"), "api.max_pool_connections", 32, lo=1),
        poll_seconds=_num(ac.get("poll_seconds"), "api.poll_seconds", 5.0, lo=0.01),
    )
    return Config(name, region, endpoint_url, emulator, launch, tuple(pools), tuple(reserved), reserve, pricing,
                  interruption, bootstrap, api, source)
