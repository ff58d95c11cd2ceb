"""The shard view's per-cluster index (added for Hello replay at scale) agrees with a full scan."""

from __future__ import annotations

import random

from bigfleet.shard.view import MachineView
from bigfleet.v1alpha1 import provider_pb2
from bigfleet.wire.machine import META_NEED_FINGERPRINT

S = provider_pb2.MachineState
CLUSTERS = ("a", "b", "c")


def machine(mid: str, state: int, cluster: str = "") -> provider_pb2.Machine:
    pb = provider_pb2.Machine(id=mid, state=state, instance_type="m5.2xlarge", zone="us-east-1a",  # type: ignore[arg-type]
                              price_per_hour=0.1, cluster=cluster, labels={"topology.kubernetes.io/zone": "us-east-1a"})
    pb.resources.resources.update({"cpu": "8", "memory": "32Gi"})
    if state != S.MACHINE_STATE_SPECULATIVE:
        pb.host.provider, pb.host.ref = "fake", f"host-{mid}"
    if cluster:
        pb.shard_metadata[META_NEED_FINGERPRINT] = "fp"
    return pb


def scan(view: MachineView, cid: str) -> set[str]:
    return {pb.id for pb in view.all() if view.route(pb) == cid}


def test_bound_to_matches_a_full_scan_through_random_changes() -> None:
    rnd = random.Random(12)
    view = MachineView()
    for step in range(3000):
        mid = f"m{rnd.randrange(60)}"
        op = rnd.random()
        if op < 0.1:
            view.forget(mid)
        elif op < 0.2:
            if rnd.random() < 0.5:
                view.reserved_for[mid] = rnd.choice(CLUSTERS)
            else:
                view.reserved_for.pop(mid, None)
        elif op < 0.4:
            view.set(machine(mid, S.MACHINE_STATE_IDLE))
        elif op < 0.5:
            view.set(machine(mid, S.MACHINE_STATE_CREATING))
        else:
            view.set(machine(mid, rnd.choice((S.MACHINE_STATE_CONFIGURED, S.MACHINE_STATE_DRAINING)),
                             rnd.choice(CLUSTERS)))
        if step % 50 == 0:
            for cid in CLUSTERS:
                got = [pb.id for pb in view.bound_to(cid)]
                assert len(got) == len(set(got))
                assert set(got) == scan(view, cid)
