"""A whole fleet as real processes on loopback: coordinator x3, two shards (each with its own fake
provider), one operator per cluster against its own k8stest API server."""

from __future__ import annotations

import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from bigfleet.coordinator.localgroup import PASSWORD_ENV, CoordGroup
from bigfleet.k8stest import KubeTestServer
from bigfleet.process.procs import health_status
from bigfleet.testing import ManagedProcess, free_port
from bigfleet.v1alpha1 import coordinator_pb2, coordinator_pb2_grpc, provider_pb2, provider_pb2_grpc

CONFIGURED = provider_pb2.MachineState.MACHINE_STATE_CONFIGURED


def cr(name: str, cpu: str = "6", priority: int = 1000) -> dict[str, Any]:
    return {"apiVersion": "bigfleet.lucy.sh/v1alpha1", "kind": "CapacityRequest",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"priority": priority, "resources": {"cpu": cpu, "memory": "1Gi"}}}


@dataclass
class E2EFleet:
    root: Path
    clusters: int = 4
    shards: int = 2
    committed: int = 10
    speculative: int = 6
    coord: CoordGroup = field(init=False)
    provider_addr: list[str] = field(default_factory=list)
    shard_addr: list[str] = field(default_factory=list)
    providers: list[ManagedProcess | None] = field(default_factory=list)
    shard_procs: list[ManagedProcess | None] = field(default_factory=list)
    operators: list[ManagedProcess] = field(default_factory=list)
    kubes: list[KubeTestServer] = field(default_factory=list)
    want: Counter[str] = field(default_factory=Counter)  # Ready UpcomingNodes each cluster should have

    def __post_init__(self) -> None:
        self.coord = CoordGroup(self.root / "coord", 3, extra=("--log-level", "warning"))
        self.logs = self.root / "logs"

    def cluster(self, i: int) -> str:
        return f"cluster-{i}"

    # -- processes -------------------------------------------------------------------------------------

    def _provider_argv(self, i: int) -> list[str]:
        return ["fake-provider", "--listen", self.provider_addr[i], "--state-file", str(self.root / f"provider-{i}.json"),
                "--committed-count", str(self.committed), "--seed-count", str(self.speculative),
                "--create-delay", "1", "--configure-delay", "0.5", "--drain-delay", "0.5", "--delete-delay", "0.5",
                "--log-format", "console", "--log-level", "warning"]

    def _shard_argv(self, i: int) -> list[str]:
        return ["shard", "--shard-id", f"shard-{i}", "--listen", self.shard_addr[i], "--provider", self.provider_addr[i],
                "--coordinator", ",".join(self.coord.addresses), "--data-dir", str(self.root / f"shard-{i}"),
                "--cycle-interval", "0.5", "--min-cycle-gap", "0.1", "--reconcile-interval", "0.3",
                "--heartbeat-interval", "1", "--execute-timeout", "20", "--bootstrap-timeout", "10",
                "--log-format", "console", "--log-level", "warning"]

    def start_provider(self, i: int) -> None:
        p = ManagedProcess.bigfleet(self._provider_argv(i), f"provider-{i}-{time.monotonic_ns()}", log_dir=self.logs)
        self.providers[i] = p.start()
        self.wait(lambda: _healthy(self.provider_addr[i]), f"provider-{i} health", 60)

    def start_shard(self, i: int) -> None:
        p = ManagedProcess.bigfleet(self._shard_argv(i), f"shard-{i}-{time.monotonic_ns()}", log_dir=self.logs)
        self.shard_procs[i] = p.start()
        self.wait(lambda: _healthy(self.shard_addr[i]), f"shard-{i} health", 60)

    def start(self) -> None:
        self.coord.start_all()
        self.coord.leader(timeout=60)
        self.provider_addr = [f"127.0.0.1:{free_port()}" for _ in range(self.shards)]
        self.shard_addr = [f"127.0.0.1:{free_port()}" for _ in range(self.shards)]
        self.providers = [None] * self.shards
        self.shard_procs = [None] * self.shards
        for i in range(self.shards):
            self.start_provider(i)
            self.start_shard(i)
        self.wait(lambda: len(self.list_shards()) == self.shards, "both shards registered", 60)
        for i in range(self.clusters):
            kube = KubeTestServer(bookmark_interval=1.0).start_in_thread()
            self.kubes.append(kube)
            kc = kube.kubeconfig(self.root / f"kubeconfig-{i}")
            op = ManagedProcess.bigfleet(
                ["operator", "--cluster-id", self.cluster(i), "--coordinator", ",".join(self.coord.addresses),
                 "--kubeconfig", str(kc), "--namespace", "default", "--metrics-addr", "0", "--rollup-interval", "1",
                 "--log-format", "console", "--log-level", "warning"],
                f"operator-{i}", log_dir=self.logs)
            self.operators.append(op.start())

    def stop(self) -> None:
        for op in self.operators:
            with _quiet():
                op.signal(signal.SIGCONT)
            op.stop(timeout=10)
        for p in [*self.shard_procs, *self.providers]:
            if p is not None:
                p.stop(timeout=10)
        self.coord.stop_all()
        for k in self.kubes:
            k.stop_thread()

    def dump_logs(self) -> str:
        out = []
        for p in [*self.operators, *self.shard_procs, *self.providers]:
            if p is not None:
                out.append(f"===== {p.name} =====\n{p.logs()[-2500:]}")
        out.append("===== coordinators =====\n" + self.coord.logs())
        return "\n".join(out)

    # -- observations ----------------------------------------------------------------------------------

    def wait(self, predicate: Any, what: str, timeout: float = 120.0) -> float:
        """Poll until true; returns the seconds it took. Fails at once if a daemon we did not kill died."""
        start = time.monotonic()
        last: BaseException | None = None
        while True:
            try:
                if predicate():
                    return time.monotonic() - start
            except Exception as exc:  # daemons refuse connections while (re)starting
                last = exc
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"timed out after {timeout:g}s waiting for {what} (last error: {last!r})")
            time.sleep(0.25)

    def list_shards(self) -> list[Any]:
        i = self.coord.leader(timeout=30)
        with grpc.insecure_channel(self.coord.addr(i)) as ch:
            return list(coordinator_pb2_grpc.CoordinatorStub(ch).ListShards(
                coordinator_pb2.ListShardsRequest(), timeout=5).shards)

    def provider_machines(self, i: int) -> list[provider_pb2.Machine]:
        with grpc.insecure_channel(self.provider_addr[i]) as ch:
            return list(provider_pb2_grpc.CapacityProviderStub(ch).List(provider_pb2.ListFilter(), timeout=10).machines)

    def ready_nodes(self, i: int) -> list[str]:
        """Machine names of the cluster's UpcomingNodes in phase Ready (what its operator was told)."""
        objs = self.kubes[i].store.objects("upcomingnodes")
        return sorted(o["metadata"]["name"] for o in objs if (o.get("status") or {}).get("phase") == "Ready")

    def add_demand(self, i: int, name: str) -> None:
        self.kubes[i].store.put(cr(name))
        self.want[self.cluster(i)] += 1

    def satisfied(self) -> bool:
        return all(len(self.ready_nodes(i)) >= self.want[self.cluster(i)] for i in range(self.clusters))

    def verify(self, timeout: float = 30.0) -> dict[str, Any]:
        """``check_nothing_lost_or_double_assigned`` once the operators' views have caught up (an
        UpcomingNode trails its machine's state by a roll-up round trip)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.check_nothing_lost_or_double_assigned()
            except (AssertionError, grpc.RpcError):
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.5)

    def check_nothing_lost_or_double_assigned(self) -> dict[str, Any]:
        """Every provider still has every machine; each Configured machine is bound to exactly one cluster,
        and the Ready UpcomingNodes across clusters match the providers' Configured machines one to one."""
        per_cluster: Counter[str] = Counter()
        total = 0
        for i in range(self.shards):
            ms = self.provider_machines(i)
            assert len(ms) == self.committed + self.speculative, f"provider-{i} has {len(ms)} machines"
            for m in ms:
                if m.state == CONFIGURED:
                    assert m.cluster, f"{m.id} Configured without a cluster"
                    per_cluster[m.cluster] += 1
                    total += 1
        ready = {self.cluster(i): len(self.ready_nodes(i)) for i in range(self.clusters)}
        # A machine claimed by two clusters would show as Ready in both: more Ready nodes than Configured.
        assert sum(ready.values()) <= total, (ready, per_cluster)
        for c, n in ready.items():
            assert n <= per_cluster[c], (c, n, per_cluster)
        return {"ready": ready, "configured": dict(per_cluster)}


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


def _healthy(addr: str) -> bool:
    return bool(health_status(addr, timeout=1.0) == health_pb2.HealthCheckResponse.SERVING)


__all__ = ["PASSWORD_ENV", "E2EFleet", "cr"]
