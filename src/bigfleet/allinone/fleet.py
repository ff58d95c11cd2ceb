"""The supervised daemons of the all-in-one: coordinator, fake provider, shard (real processes)."""

from __future__ import annotations

import secrets
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from bigfleet.testing import ManagedProcess, free_port
from bigfleet.testing.procs import health_status
from bigfleet.v1alpha1 import shardread_pb2, shardread_pb2_grpc


@dataclass
class FleetSpec:
    committed: int
    speculative: int
    cycle_interval: float = 1.0
    dwell: tuple[float, float, float, float] = (2.0, 1.0, 1.0, 1.0)  # create, configure, drain, delete
    execute_timeout: float = 30.0
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bigfleet-all-in-one-")))


@dataclass
class Fleet:
    spec: FleetSpec
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    addrs: dict[str, str] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)

    def _addr(self) -> str:
        return f"127.0.0.1:{free_port()}"

    def start(self) -> None:
        sp, logs = self.spec, self.spec.workdir / "logs"
        self.addrs = {"provider": self._addr(), "coordinator": self._addr(), "raft": self._addr(),
                      "shard": self._addr(), "shard-metrics": self._addr()}
        c, cf, dr, de = sp.dwell
        sp.workdir.mkdir(parents=True, exist_ok=True)
        pw = sp.workdir / "raft-password"
        pw.write_text(secrets.token_hex(24))
        pw.chmod(0o600)
        self.argv["provider"] = [
            "fake-provider", "--listen", self.addrs["provider"], "--seed-count", str(sp.speculative),
            "--state-file", str(sp.workdir / "provider-state.json"),  # a restarted provider keeps its machines
            "--committed-count", str(sp.committed), "--create-delay", str(c), "--configure-delay", str(cf),
            "--drain-delay", str(dr), "--delete-delay", str(de), "--log-format", "console", "--log-level", "warning",
        ]
        self.argv["coordinator"] = [
            "coordinator", "--node-id", "coord-1", "--listen", self.addrs["coordinator"],
            "--raft-bind", self.addrs["raft"], "--data-dir", str(sp.workdir / "coordinator"),
            "--raft-password-file", str(pw),
            "--log-format", "console", "--log-level", "warning",
        ]
        self.argv["shard"] = [
            "shard", "--shard-id", "shard-1", "--listen", self.addrs["shard"], "--provider", self.addrs["provider"],
            "--coordinator", self.addrs["coordinator"], "--data-dir", str(sp.workdir / "shard"),
            "--metrics-listen", self.addrs["shard-metrics"], "--cycle-interval", str(sp.cycle_interval),
            "--execute-timeout", str(sp.execute_timeout), "--heartbeat-interval", "2",
            "--log-format", "console", "--log-level", "warning",
        ]
        for name in ("provider", "coordinator", "shard"):
            self.procs[name] = ManagedProcess.bigfleet(self.argv[name], name, log_dir=logs).start()
            self.restarts[name] = 0
            self._wait_up(name)

    def _wait_up(self, name: str, timeout: float = 90.0) -> None:
        """Health SERVING, or a clear error with the daemon's last log lines if it exited first."""
        deadline = time.monotonic() + timeout
        p = self.procs[name]
        while True:
            if not p.alive():
                raise RuntimeError(f"{name} exited during start-up:\n{p.logs()[-2000:]}")
            try:
                if health_status(self.addrs[name], timeout=1.0) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except Exception:  # not listening yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not healthy after {timeout:g}s:\n{p.logs()[-2000:]}")
            time.sleep(0.2)

    def check(self) -> list[str]:
        """Restart a daemon that died (the all-in-one is a supervisor); returns the names restarted."""
        out = []
        for name, p in self.procs.items():
            if not p.alive():
                self.restarts[name] += 1
                self.procs[name] = ManagedProcess.bigfleet(self.argv[name], name, log_dir=p.log_dir).start()
                out.append(name)
        return out

    def stop(self) -> None:
        for name in ("shard", "coordinator", "provider"):
            p = self.procs.get(name)
            if p is not None:
                p.stop()

    # -- what the view reads -----------------------------------------------------------------------

    async def counts(self) -> shardread_pb2.InventoryCounts:
        from bigfleet.rpc import insecure_channel

        async with insecure_channel(self.addrs["shard"]) as ch:
            r: shardread_pb2.InventoryCounts = await shardread_pb2_grpc.ShardReadStub(ch).GetInventoryCounts(
                shardread_pb2.InventoryCountsRequest(), timeout=5)
            return r

    async def shortfalls(self) -> shardread_pb2.ListShortfallsResponse:
        from bigfleet.rpc import insecure_channel

        async with insecure_channel(self.addrs["shard"]) as ch:
            r: shardread_pb2.ListShortfallsResponse = await shardread_pb2_grpc.ShardReadStub(ch).ListShortfalls(
                shardread_pb2.ListShortfallsRequest(), timeout=5)
            return r

    async def shards_registered(self) -> int:
        """Shards the coordinator knows (it answers only as leader: a single replica is its own)."""
        from bigfleet.rpc import insecure_channel
        from bigfleet.v1alpha1 import coordinator_pb2, coordinator_pb2_grpc

        async with insecure_channel(self.addrs["coordinator"]) as ch:
            r = await coordinator_pb2_grpc.CoordinatorStub(ch).ListShards(coordinator_pb2.ListShardsRequest(), timeout=5)
            return len(r.shards)

    def metrics(self) -> dict[str, float]:
        """Shard counters worth showing, flattened as ``name{label}`` -> value."""
        with urllib.request.urlopen(f"http://{self.addrs['shard-metrics']}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "bigfleet_shard_actions_total":
                    out[f"actions:{s.labels.get('kind', '')}"] = s.value
                elif s.name == "bigfleet_shard_cycles_total":
                    out["cycles"] = s.value
                elif s.name == "bigfleet_shard_rollups_total":
                    out["rollups"] = s.value
                elif s.name == "bigfleet_shard_action_execute_outcomes_total":
                    key = f"outcome:{s.labels.get('kind', '')}:{s.labels.get('outcome', '')}"
                    out[key] = s.value
        return out
