"""Steady-state seeding for `bigfleet scaletest --prebind`: which catalog machines start CONFIGURED.

A scale run that starts from an empty fleet measures reprovisioning, not the steady state a real
shard lives in. To start in steady state the fake provider must already hold, for every simulated
cluster, the bound machines a shard would have configured for its demand, stamped with the same
``cluster`` and ``shard_metadata`` a shard's Configure writes (the shard rebuilds its inventory from
exactly those after a restart).

Rather than re-deriving placement rules, this asks the decision engine itself: the fake catalog
(the same deterministic generator the provider uses) and the workload's first roll-ups (the same
pure generator the load generators use) go through one `decide()`; every Configure/Create it
issues becomes a pre-bound machine carrying that action's assignment. The first cycles of the run
then find the demand met by bound machines: ~0 binds and ~0 reclaims if the seed matches.

Pure (no clock: the arrival time is a fixed constant); the file format is the fake provider's
(`bigfleet.provider.fake.seed`).
"""

from __future__ import annotations

from collections.abc import Iterable

from bigfleet.decision import Configure, Create, Decision, EngineConfig, EngineState, decide
from bigfleet.machine import Assignment, Machine
from bigfleet.needs import Need
from bigfleet.provider.fake.catalog import build_catalog
from bigfleet.provider.fake.seed import Binding, read_seed, write_seed
from bigfleet.provider.kit.model import Instance, record_from_instance, validate_instance
from bigfleet.scale.workloads import cluster_id, rollup_needs
from bigfleet.wire.machine import encode_shard_metadata, machine_from_proto
from bigfleet.wire.needs import need_from_proto

#: the owner key the shard stamps into Configure when it runs with the handoff (shard/handoff.py)
OWNER_KEY = "bigfleet.lucy.sh/owner-shard"


def catalog_machines(instances: Iterable[Instance]) -> list[Machine]:
    """The engine's view of catalog instances, through the same wire conversion a shard's List uses.

    Host-less slots that differ only by id are converted once per distinct rest (a 500K catalog
    has a few dozen), the others copied with their id: same records, a fraction of the time.
    """
    out = []
    seen: dict[tuple[object, ...], Machine] = {}
    for inst in instances:
        state = validate_instance(inst)
        key: tuple[object, ...] | None = None
        if inst.host is None:
            key = (state, inst.instance_type, inst.zone, inst.capacity_type, inst.price_per_hour,
                   inst.interruption_probability, tuple(sorted(inst.labels.items())),
                   tuple(sorted(inst.resources.items())), tuple(sorted(inst.allocatable.items())))
            base = seen.get(key)
            if base is not None:
                out.append(base.replace(id=inst.id))
                continue
        m = machine_from_proto(record_from_instance(inst, state).to_proto())
        if key is not None:
            seen[key] = m
        out.append(m)
    return out


def workload_needs(shape: str, clusters: int, machines_per_cluster: float, needs_per_cluster: int = 3,
                   first: int = 0) -> list[Need]:
    """The first roll-up (variant 0) of clusters ``first .. first+clusters-1``, as engine Needs."""
    out: list[Need] = []
    for i in range(first, first + clusters):
        cid = cluster_id(i)
        for k, pb in enumerate(rollup_needs(shape, i, machines_per_cluster, 0, needs_per_cluster)):
            out.append(need_from_proto(pb, cid, 0, f"needs[{k}]"))
    return out


def bindings_from_decision(d: Decision, owner_shard: str = "") -> list[Binding]:
    """Every bind the engine issued, with the metadata the shard's executor would stamp."""
    out = []
    for a in (*d.actions, *d.suppressed):
        if not isinstance(a, (Configure, Create)):
            continue
        md = encode_shard_metadata(Assignment(a.priority, a.interruption_penalty_dollars,
                                              a.reclamation_penalty_dollars, a.need_fingerprint, a.group))
        if owner_shard:
            md[OWNER_KEY] = owner_shard
        out.append(Binding(a.machine_id, a.cluster_id, md))
    out.sort(key=lambda b: b.machine_id)
    return out


def plan(shape: str, clusters: int, seed_count: int, committed_count: int, demand_fraction: float,
         needs_per_cluster: int = 3, provider: str = "fake", owner_shard: str = "") -> tuple[list[Binding], Decision]:
    """Bindings that satisfy the workload's first roll-ups on the fake catalog of these sizes.

    Sizing follows `bigfleet scaletest`: total demand = (speculative + committed) × demand_fraction,
    spread evenly over the clusters.
    """
    catalog = build_catalog(seed_count, committed_count, provider)
    machines = catalog_machines(catalog)
    per_cluster = (seed_count + committed_count) * demand_fraction / max(1, clusters)
    needs = workload_needs(shape, clusters, per_cluster, needs_per_cluster)
    ids = frozenset(cluster_id(i) for i in range(clusters))
    d = decide(needs, machines, 0, EngineState(first_rollup=ids), EngineConfig(max_actions_per_cycle=0))
    return bindings_from_decision(d, owner_shard), d


__all__ = ["Binding", "bindings_from_decision", "build_catalog", "catalog_machines", "plan", "read_seed", "workload_needs",
           "write_seed"]
