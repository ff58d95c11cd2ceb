"""The supervised daemons of the all-in-one: coordinator, fake provider, shard (real processes).

With ``tls`` every hop is mTLS with the role identities a production fleet uses: a local CA (reused
when ``pki_dir`` already holds one) issues ``shard-<id>`` for the shard (its certificate is also
what it presents to the provider and the coordinator), ``cluster-<id>`` for each simulated
operator, ``admin`` for the coordinator and for this process's own reads, ``readonly`` for the
provider's server side.

The shard serves the read-only dashboard (``--http-listen``) on loopback: ``dashboard_url``.

With ``aws_emulator`` the pool spans two providers (docs/shard.md, one pool across providers): the
fake provider offers only its bare metal (``--cloud onprem``) and the AWS provider
(``bigfleet-provider-aws``, a separate package) offers on-demand and spot against a moto server
started here; the shard is given both (``--provider metal=... --provider aws=...``).
"""

from __future__ import annotations

import secrets
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bigfleet.process import ManagedProcess, free_port
from bigfleet.security import TLSConfig, dial, dial_sync
from bigfleet.security.certs import make_local_pki
from bigfleet.v1alpha1 import provider_pb2, provider_pb2_grpc, shardread_pb2, shardread_pb2_grpc

SHARD_ID = "shard-1"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback never goes through a proxy


@dataclass
class FleetSpec:
    committed: int
    speculative: int
    cycle_interval: float = 1.0
    dwell: tuple[float, float, float, float] = (2.0, 1.0, 1.0, 1.0)  # create, configure, drain, delete
    execute_timeout: float = 30.0
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bigfleet-all-in-one-")))
    tls: bool = False
    # Where the local PKI lives (default <workdir>/pki); an existing ca.crt/ca.key there is reused.
    pki_dir: Path | None = None
    # Simulated clusters: each gets its own cluster certificate under TLS.
    cluster_ids: tuple[str, ...] = ()
    # The shard's dashboard port on 127.0.0.1 (0: a free one).
    dashboard_port: int = 0
    # Bare metal from the fake provider plus on-demand/spot from the AWS provider on a local moto.
    aws_emulator: bool = False

    @property
    def pki(self) -> Path:
        return self.pki_dir or self.workdir / "pki"


@dataclass
class Fleet:
    spec: FleetSpec
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    addrs: dict[str, str] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)
    # Daemons that are not `bigfleet` subcommands (moto, the AWS provider): argv is the whole command.
    external: set[str] = field(default_factory=set)

    @property
    def providers(self) -> dict[str, str]:
        """The shard's providers: name -> address ("" names the single provider of the plain fleet)."""
        if self.spec.aws_emulator:
            return {METAL: self.addrs["provider"], AWS: self.addrs["aws"]}
        return {"": self.addrs["provider"]}

    def _spawn(self, name: str, log_dir: Path) -> ManagedProcess:
        if name in self.external:
            return ManagedProcess(self.argv[name], name, log_dir=log_dir).start()
        return ManagedProcess.bigfleet(self.argv[name], name, log_dir=log_dir).start()

    def _addr(self) -> str:
        return f"127.0.0.1:{free_port()}"

    def tls_for(self, stem: str) -> TLSConfig | None:
        """The TLS config of one identity (``admin``, ``shard-shard-1``, ``cluster-<id>``...); None in plaintext."""
        if not self.spec.tls:
            return None
        d = self.spec.pki
        return TLSConfig.from_paths(d / f"{stem}.crt", d / f"{stem}.key", d / "ca.crt")

    def tls_flags(self, stem: str) -> list[str]:
        """``--tls-cert/--tls-key/--tls-ca`` of one identity; [] in plaintext."""
        if not self.spec.tls:
            return []
        d = self.spec.pki
        return ["--tls-cert", str(d / f"{stem}.crt"), "--tls-key", str(d / f"{stem}.key"), "--tls-ca", str(d / "ca.crt")]

    def start(self) -> None:
        sp, logs = self.spec, self.spec.workdir / "logs"
        self.addrs = {"provider": self._addr(), "coordinator": self._addr(), "raft": self._addr(),
                      "shard": self._addr(), "shard-metrics": self._addr(),
                      "dashboard": f"127.0.0.1:{sp.dashboard_port}" if sp.dashboard_port else self._addr()}
        c, cf, dr, de = sp.dwell
        sp.workdir.mkdir(parents=True, exist_ok=True)
        pw = sp.workdir / "raft-password"
        pw.write_text(secrets.token_hex(24))
        pw.chmod(0o600)
        if sp.tls:
            make_local_pki(sp.pki, clusters=sp.cluster_ids, shards=(SHARD_ID,))
        self.argv["provider"] = [
            "fake-provider", "--listen", self.addrs["provider"],
            "--state-file", str(sp.workdir / "provider-state.json"),  # a restarted provider keeps its machines
            *(["--cloud", "onprem", "--seed-count", "0"] if sp.aws_emulator else ["--seed-count", str(sp.speculative)]),
            "--committed-count", str(sp.committed), "--create-delay", str(c), "--configure-delay", str(cf),
            "--drain-delay", str(dr), "--delete-delay", str(de), "--log-format", "console", "--log-level", "warning",
            *self.tls_flags("readonly"),
        ]
        order = ["provider", "coordinator", "shard"]
        if sp.aws_emulator:
            self.addrs["moto"], self.addrs["aws"] = f"127.0.0.1:{free_port()}", self._addr()
            host, _, port = self.addrs["moto"].partition(":")
            self.argv["moto"] = [sys.executable, "-m", "moto.server", "-H", host, "-p", port]
            cfg = sp.workdir / "aws-emulator.yaml"
            cfg.write_text(yaml.safe_dump(aws_emulator_config(f"http://{self.addrs['moto']}", sp.speculative)))
            self.argv["aws"] = [
                sys.executable, "-m", "bigfleet_provider_aws", "--config", str(cfg), "--listen", self.addrs["aws"],
                "--state-file", str(sp.workdir / "aws-provider-state.json"), "--reconcile-interval", "5",
                "--log-format", "console", "--log-level", "warning", *self.tls_flags("readonly"),
            ]
            self.external |= {"moto", "aws"}
            order = ["moto", "provider", "aws", "coordinator", "shard"]
        provider_flags = [f for name, addr in self.providers.items()
                          for f in ("--provider", f"{name}={addr}" if name else addr)]
        self.argv["coordinator"] = [
            "coordinator", "--node-id", "coord-1", "--listen", self.addrs["coordinator"],
            "--raft-bind", self.addrs["raft"], "--data-dir", str(sp.workdir / "coordinator"),
            "--raft-password-file", str(pw),
            "--log-format", "console", "--log-level", "warning", *self.tls_flags("admin"),
        ]
        self.argv["shard"] = [
            "shard", "--shard-id", SHARD_ID, "--listen", self.addrs["shard"], *provider_flags,
            "--coordinator", self.addrs["coordinator"], "--data-dir", str(sp.workdir / "shard"),
            "--metrics-listen", self.addrs["shard-metrics"], "--http-listen", self.addrs["dashboard"],
            "--cycle-interval", str(sp.cycle_interval),
            "--execute-timeout", str(sp.execute_timeout), "--heartbeat-interval", "2",
            "--log-format", "console", "--log-level", "warning", *self.tls_flags(f"shard-{SHARD_ID}"),
        ]
        for name in order:
            self.procs[name] = self._spawn(name, logs)
            self.restarts[name] = 0
            if name == "moto":
                self._wait_moto()
            else:
                self._wait_up(name)
        self._wait_registered()

    def _wait_moto(self, timeout: float = 60.0) -> None:
        deadline, p = time.monotonic() + timeout, self.procs["moto"]
        while True:
            if not p.alive():
                raise RuntimeError(f"moto exited during start-up:\n{p.logs()[-2000:]}")
            try:
                with _NO_PROXY.open(f"http://{self.addrs['moto']}/moto-api/", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except Exception:  # not listening yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto not answering after {timeout:g}s:\n{p.logs()[-2000:]}")
            time.sleep(0.2)

    @property
    def coordinators(self) -> tuple[str, ...]:
        """The coordinator address(es) operators and bigfleetctl are given (one replica here)."""
        return (self.addrs["coordinator"],)

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.addrs['dashboard']}/"

    def _wait_registered(self, timeout: float = 60.0) -> None:
        """Until the coordinator lists the shard: before that a cluster's LookupCluster finds no live shard."""
        from bigfleet.v1alpha1 import coordinator_pb2, coordinator_pb2_grpc

        deadline = time.monotonic() + timeout
        while True:
            try:
                with dial_sync(self.addrs["coordinator"], self.tls_for("admin")) as ch:
                    r = coordinator_pb2_grpc.CoordinatorStub(ch).ListShards(coordinator_pb2.ListShardsRequest(),
                                                                            timeout=2.0)
                if any(s.shard_id == SHARD_ID for s in r.shards):
                    return
            except Exception:  # no leader yet, or the shard has not reported
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the shard did not register with the coordinator within {timeout:g}s:\n"
                                   f"{self.procs['shard'].logs()[-2000:]}")
            time.sleep(0.2)

    def wait_dashboard(self, timeout: float = 20.0) -> bool:
        """True once the dashboard answers (the shard opens it after its first reconcile)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with _NO_PROXY.open(f"{self.dashboard_url}healthz", timeout=2) as resp:
                    if resp.status == 200:
                        return True
            except Exception:
                pass
            if time.monotonic() > deadline or not self.procs["shard"].alive():
                return False
            time.sleep(0.2)

    def _wait_up(self, name: str, timeout: float = 90.0) -> None:
        """Health SERVING, or a clear error with the daemon's last log lines if it exited first."""
        deadline = time.monotonic() + timeout
        p = self.procs[name]
        while True:
            if not p.alive():
                raise RuntimeError(f"{name} exited during start-up:\n{p.logs()[-2000:]}")
            try:
                if self._health(self.addrs[name]) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except Exception:  # not listening yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not healthy after {timeout:g}s:\n{p.logs()[-2000:]}")
            time.sleep(0.2)

    def _health(self, target: str) -> int:
        with dial_sync(target, self.tls_for("admin")) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            return int(resp.status)

    def check(self) -> list[str]:
        """Restart a daemon that died (the all-in-one is a supervisor); returns the names restarted."""
        out = []
        for name, p in self.procs.items():
            if not p.alive():
                self.restarts[name] += 1
                self.procs[name] = self._spawn(name, p.log_dir or self.spec.workdir / "logs")
                out.append(name)
        return out

    def stop(self) -> None:
        for name in ("shard", "coordinator", "aws", "provider", "moto"):
            p = self.procs.get(name)
            if p is not None:
                p.stop()

    # -- what the view reads -----------------------------------------------------------------------

    async def pool(self) -> dict[tuple[str, str, str], int]:
        """(provider, capacity type, state) -> machines, read from each provider (one pool, several sources)."""
        out: dict[tuple[str, str, str], int] = {}
        for name, addr in self.providers.items():
            async with dial(addr, self.tls_for(f"shard-{SHARD_ID}")) as ch:
                lst = await provider_pb2_grpc.CapacityProviderStub(ch).List(provider_pb2.ListFilter(), timeout=10)
            for m in lst.machines:
                key = (name or "provider", _capacity(m.capacity_type), _state(m.state))
                out[key] = out.get(key, 0) + 1
        return out

    async def counts(self) -> shardread_pb2.InventoryCounts:
        async with dial(self.addrs["shard"], self.tls_for("admin")) as ch:
            r: shardread_pb2.InventoryCounts = await shardread_pb2_grpc.ShardReadStub(ch).GetInventoryCounts(
                shardread_pb2.InventoryCountsRequest(), timeout=5)
            return r

    async def shortfalls(self) -> shardread_pb2.ListShortfallsResponse:
        async with dial(self.addrs["shard"], self.tls_for("admin")) as ch:
            r: shardread_pb2.ListShortfallsResponse = await shardread_pb2_grpc.ShardReadStub(ch).ListShortfalls(
                shardread_pb2.ListShortfallsRequest(), timeout=5)
            return r

    async def shards_registered(self) -> int:
        """Shards the coordinator knows (it answers only as leader: a single replica is its own)."""
        from bigfleet.v1alpha1 import coordinator_pb2, coordinator_pb2_grpc

        async with dial(self.addrs["coordinator"], self.tls_for("admin")) as ch:
            r = await coordinator_pb2_grpc.CoordinatorStub(ch).ListShards(coordinator_pb2.ListShardsRequest(), timeout=5)
            return len(r.shards)

    async def bindings(self) -> dict[str, str]:
        """cluster -> shard id, as the coordinator holds them (what ``bigfleetctl clusters`` lists)."""
        from bigfleet.v1alpha1 import coordinator_pb2, coordinator_pb2_grpc

        async with dial(self.addrs["coordinator"], self.tls_for("admin")) as ch:
            r = await coordinator_pb2_grpc.CoordinatorStub(ch).ListClusterBindings(
                coordinator_pb2.ListClusterBindingsRequest(), timeout=5)
            return {b.cluster_id: b.shard_id for b in r.bindings}

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


METAL, AWS = "metal", "aws"


def _capacity(v: int) -> str:
    return provider_pb2.CapacityType.Name(v).removeprefix("CAPACITY_TYPE_").lower().replace("_", "-")  # type: ignore[arg-type]


def _state(v: int) -> str:
    return provider_pb2.MachineState.Name(v).removeprefix("MACHINE_STATE_").lower()  # type: ignore[arg-type]


def aws_emulator_config(endpoint_url: str, slots: int) -> dict[str, object]:
    """The AWS provider's configuration for a local moto server: m5.2xlarge on-demand and spot in three
    zones (the fake provider's bare metal is the same 8-vCPU shape), ``slots`` in all."""
    zones = ["us-east-1a", "us-east-1b", "us-east-1c"]
    return {
        "provider_name": "aws-emulator",
        "region": "us-east-1",
        "endpoint_url": endpoint_url,
        "emulator_credentials": True,  # moto accepts any key; used only when the boto3 chain has none
        "launch": {"image_id": "ami-1e749f67", "tags": {"bigfleet.lucy.sh/all-in-one": "true"}},
        "supply": {"pools": [{"instance_types": ["m5.2xlarge"], "zones": zones,
                              "capacity_types": ["on-demand", "spot"],
                              "slots": max(1, -(-slots // (2 * len(zones))))}]},
        "system_reserve": {"cpu": "100m", "memory": "512Mi", "max_pods": 110},
        "pricing": {"on_demand": {"m5.2xlarge": 0.384}, "spot_fallback_fraction": 0.35},
        "interruption": {"default_probability": 0.05},
        "api": {"poll_seconds": 0.05, "max_attempts": 3},
    }
