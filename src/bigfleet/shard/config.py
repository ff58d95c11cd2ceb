"""Shard configuration: flags, then environment (``BIGFLEET_SHARD_*``), then an optional YAML file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ShardSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BIGFLEET_SHARD_", extra="forbid")

    shard_id: str = "shard-0"
    listen: str = "127.0.0.1:7780"
    # HOST:PORT, or NAME=HOST:PORT[@exclusive|@shared] comma-separated (several providers, one pool:
    # bigfleet.shard.providers); a YAML list of those is accepted too.
    provider: str = ""
    metrics_listen: str = ""
    http_listen: str = ""
    coordinator: str = ""
    advertise: str = ""
    data_dir: str = "./data"
    cycle_interval: float = Field(10.0, gt=0)
    min_cycle_gap: float = Field(0.2, ge=0)
    bootstrap_timeout: float = Field(30.0, gt=0)
    execute_timeout: float = Field(30.0, gt=0)
    execute_concurrency: int = Field(256, ge=1)  # provider mutations + bootstrap pulls in flight
    reclaim_ack_timeout: float = Field(10.0, gt=0)
    reconcile_interval: float = Field(1.0, ge=0)
    provider_start_grace: float = Field(15.0, ge=0)
    full_reconcile_every: int = Field(300, ge=1)  # a full List at 500k machines is ~100 MB
    available_capacity_interval: float = Field(5.0, ge=0)
    available_capacity_rate: float = Field(1000.0, ge=0)  # hint frames per second, shard-wide; 0 = unpaced
    reclaim_cap_fraction: float = Field(0.05, ge=0, le=1)
    # Disruption budget rules (docs/disruption-budgets.md): per cluster (when its operator sends
    # none; empty = max(1, reclaim_cap_fraction) per cycle_interval to reclaim) and fleet-wide.
    disruption_budget: list[str] = Field(default_factory=list)
    fleet_disruption_budget: list[str] = Field(default_factory=list)
    # Idle elastic machines are released (Delete) after this long; 0 or less: never.
    on_demand_hold_seconds: int = 600
    spot_hold_seconds: int = 60
    empty_rollup_guard: bool = True
    dry_run: bool = False
    paused: bool = False
    # Consolidation (docs/consolidation.md): off unless set; a cluster's roll-up may override it.
    consolidation: bool = False
    consolidation_margin: float = Field(0.10, ge=0, lt=1)
    consolidation_payback_hours: float = Field(24.0, gt=0)
    consolidation_max_moves: int = Field(4, ge=1)
    heartbeat_interval: float = Field(10.0, gt=0)
    # Where the decision engine runs (see DaemonConfig.engine_mode).
    engine_mode: Literal["worker", "inline"] = "worker"
    engine_timeout: float = Field(120.0, gt=0)
    engine_nice: int = Field(10, ge=0, le=19)
    # Which provider machines are this shard's when shards share a provider (see shard/handoff.py).
    ownership: Literal["exclusive", "shared"] = "exclusive"
    gil_switch_interval: float = Field(0.0005, gt=0, le=0.1)
    replica_id: str = ""
    raft_bind: str = ""
    raft_peers: str = ""
    raft_password: str = ""
    # Replica-group Raft timings (a group of one keeps pysyncobj's short defaults: it has no peer to
    # lose). Longer than the coordinator's: the shard's Raft member shares a process (and its GIL)
    # with the session loop, and a new leader at 100 000+ machines holds the GIL for 0.3-6 s at a
    # time while it reads the inventory; shorter timeouts voted such leaders out again and again
    # (docs/perf/shard-ha.md, failover at scale).
    raft_election_min: float = Field(3.0, gt=0)
    raft_election_max: float = Field(6.0, gt=0)
    raft_leader_fallback: float = Field(6.0, gt=0)
    log_level: str = "info"
    log_format: str = "json"

    @field_validator("disruption_budget", "fleet_disruption_budget")
    @classmethod
    def _budget(cls, v: list[str]) -> list[str]:
        from bigfleet.budget import parse_budget

        parse_budget(v)  # a bad rule is a configuration error at start-up, with its reason
        return v

    @field_validator("provider", mode="before")
    @classmethod
    def _providers(cls, v: Any) -> Any:
        from bigfleet.shard.providers import parse_provider_specs

        if isinstance(v, list | tuple):
            if not all(isinstance(x, str) for x in v):
                raise ValueError("provider: expected HOST:PORT or a list of NAME=HOST:PORT strings")
            v = ",".join(v)
        if isinstance(v, str) and v:
            parse_provider_specs(v)  # a malformed value is a start-up error naming it
        return v

    @field_validator("listen", "metrics_listen", "advertise", "raft_bind")
    @classmethod
    def _hostport(cls, v: str) -> str:
        if v and (":" not in v or not v.rpartition(":")[2].isdigit()):
            raise ValueError(f"expected HOST:PORT, got {v!r}")
        return v


def load_settings(config_file: str | None, overrides: dict[str, Any]) -> ShardSettings:
    """File values < environment < explicit flags."""
    file_values: dict[str, Any] = {}
    if config_file:
        raw = yaml.safe_load(Path(config_file).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{config_file}: expected a mapping")
        file_values = {k.replace("-", "_"): v for k, v in raw.items()}
    env_only = ShardSettings()  # type: ignore[call-arg]
    env_set = {k: getattr(env_only, k) for k in env_only.model_fields_set}
    merged = {**file_values, **env_set, **{k: v for k, v in overrides.items() if v is not None}}
    return ShardSettings.model_validate(merged)
