"""A group of real `bigfleet coordinator` processes on loopback (tests, benchmarks, local demos)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc

from bigfleet.coordclient.client import DIRECT_METADATA
from bigfleet.process import ManagedProcess, free_port, wait_until
from bigfleet.v1alpha1 import coordinator_pb2 as pb
from bigfleet.v1alpha1 import coordinator_pb2_grpc as pbg

PASSWORD_ENV = {"BIGFLEET_RAFT_PASSWORD": "test-raft-password"}


class CoordGroup:
    def __init__(self, root: Path, n: int = 3, extra: tuple[str, ...] = ()) -> None:
        self.root = root
        self.n = n
        self.extra = list(extra)
        self.grpc_ports = [free_port() for _ in range(n)]
        self.raft_ports = [free_port() for _ in range(n)]
        self.procs: list[ManagedProcess | None] = [None] * n
        self._channels: dict[int, grpc.Channel] = {}

    def addr(self, i: int) -> str:
        return f"127.0.0.1:{self.grpc_ports[i]}"

    def raft_addr(self, i: int) -> str:
        return f"127.0.0.1:{self.raft_ports[i]}"

    @property
    def addresses(self) -> list[str]:
        return [self.addr(i) for i in range(self.n)]

    def data_dir(self, i: int) -> Path:
        return self.root / f"node-{i}"

    def args(self, i: int, peers: list[int] | None = None) -> list[str]:
        peer_idx = [j for j in range(self.n) if j != i] if peers is None else peers
        return [
            "coordinator",
            "--node-id", f"node-{i}",
            "--listen", self.addr(i),
            "--raft-bind", self.raft_addr(i),
            "--raft-peers", ",".join(self.raft_addr(j) for j in peer_idx),
            "--data-dir", str(self.data_dir(i)),
            "--log-format", "console",
            *self.extra,
        ]

    def start(self, i: int, peers: list[int] | None = None) -> ManagedProcess:
        p = ManagedProcess.bigfleet(self.args(i, peers), f"coord-{i}-{int(time.time() * 1000)}", env=PASSWORD_ENV, log_dir=self.root / "logs")
        p.start()
        self.procs[i] = p
        return p

    def start_all(self, wait: bool = True) -> None:
        for i in range(self.n):
            self.start(i)
        if wait:
            self.wait_up()

    def wait_up(self, timeout: float = 30.0) -> None:
        """Every started replica answers gRPC health (its server is listening)."""
        for i, p in enumerate(self.procs):
            if p is not None:
                p.wait_healthy(self.addr(i), timeout=timeout)

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None:
            p.kill()
        self.procs[i] = None

    def stop_all(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
        for i, p in enumerate(self.procs):
            if p is not None:
                p.stop(timeout=5)
            self.procs[i] = None

    def alive(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p is not None and p.alive()]

    def is_leader(self, i: int, timeout: float = 0.5) -> bool:
        """Replica ``i`` answers a call it may not forward (a follower would forward the rest)."""
        with grpc.insecure_channel(self.addr(i)) as ch:
            try:
                pbg.CoordinatorStub(ch).ListShards(pb.ListShardsRequest(), timeout=timeout, metadata=DIRECT_METADATA)
                return True
            except grpc.RpcError:
                return False

    def leader(self, timeout: float = 20.0, among: list[int] | None = None) -> int:
        def find() -> int | None:
            for i in among if among is not None else self.alive():
                if self.is_leader(i):
                    return i + 1  # truthy
            return None

        found: int = wait_until(find, timeout, interval=0.02, what="a coordinator leader")  # type: ignore[assignment]
        return found - 1

    def call(
        self, i: int, method: str, req: object, timeout: float = 5.0, metadata: tuple[tuple[str, str], ...] = ()
    ) -> object:
        """``method`` on replica ``i`` (a follower forwards it to the leader unless ``metadata``
        is :data:`~bigfleet.coordclient.client.DIRECT_METADATA`)."""
        ch = self._channels.get(i)
        if ch is None:
            ch = self._channels[i] = grpc.insecure_channel(self.addr(i))
        return getattr(pbg.CoordinatorStub(ch), method)(req, timeout=timeout, metadata=metadata or None)

    def logs(self) -> str:
        return "\n".join(p.logs()[-3000:] for p in self.procs if p is not None)
