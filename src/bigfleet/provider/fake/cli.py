"""`bigfleet fake-provider`: the provider kit over the simulated cloud, as a daemon."""

from __future__ import annotations

import argparse

from bigfleet.provider.fake.backend import Dwell, FaultPlan, FaultRule, SimulatedCloud
from bigfleet.provider.fake.catalog import COMMITTED, ELASTIC, build_catalog
from bigfleet.provider.kit.model import TAINT_EFFECTS, Kind, Taint
from bigfleet.provider.kit.runner import add_common_args, run


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _taint(text: str) -> Taint:
    """``KEY[=VALUE]:EFFECT``, kubectl's spelling."""
    kv, sep, effect = text.rpartition(":")
    key, _, value = kv.partition("=")
    if not sep or not key or effect not in TAINT_EFFECTS:
        raise argparse.ArgumentTypeError(f"expected KEY[=VALUE]:EFFECT with EFFECT in {TAINT_EFFECTS}, got {text!r}")
    return Taint(key, effect, value)


def _kinds(text: str) -> frozenset[Kind]:
    try:
        return frozenset(Kind(k.strip()) for k in text.split(",") if k.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"kinds are create,configure,drain,delete: {exc}") from exc


def _nonneg(text: str) -> float:
    v = float(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return v


CLOUDS = frozenset(t.cloud for t in (*COMMITTED, *ELASTIC))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bigfleet fake-provider", description=__doc__)
    add_common_args(p)
    p.add_argument("--seed-count", type=int, default=64, help="SPECULATIVE slots on first boot (default 64)")
    p.add_argument("--committed-count", type=int, default=0,
                   help="IDLE committed hosts (bare metal, reserved) on first boot (default 0)")
    p.add_argument("--provider-name", default="fake", help="prefix of HostRef.provider")
    p.add_argument("--cloud", action="append", default=[], choices=sorted(CLOUDS), metavar="CLOUD",
                   help="offer only this simulated cloud's tiers (repeatable; onprem is the bare metal): e.g. "
                        "--cloud onprem for a rack of bare metal next to a real cloud's provider (default: all)")
    p.add_argument("--create-delay", type=_nonneg, default=0.0, help="seconds a Create takes (0 = instant)")
    p.add_argument("--configure-delay", type=_nonneg, default=0.0)
    p.add_argument("--drain-delay", type=_nonneg, default=0.0)
    p.add_argument("--delete-delay", type=_nonneg, default=0.0)
    p.add_argument("--fail-cluster", action="append", default=[], metavar="CLUSTER",
                   help="fail transitions of machines bound for / to this cluster")
    p.add_argument("--hang-cluster", action="append", default=[], metavar="CLUSTER")
    p.add_argument("--fail-label", action="append", default=[], type=_label, metavar="KEY=VALUE")
    p.add_argument("--hang-label", action="append", default=[], type=_label, metavar="KEY=VALUE")
    p.add_argument("--fault-kinds", type=_kinds, default=frozenset(Kind),
                   help="kinds the fail/hang rules and --fail-rate apply to (default all)")
    p.add_argument("--fail-rate", type=float, default=0.0, help="probability in [0,1] a transition fails")
    p.add_argument("--fault-seed", type=int, default=0)
    p.add_argument("--list-seed", type=int, default=None, help="seed List's order randomisation")
    p.add_argument("--prebind-file", default="",
                   help="JSON seed of catalog machines that start CONFIGURED for a cluster (bigfleet scaletest "
                        "--prebind writes one); not with --state-file")
    p.add_argument("--node-taint", action="append", default=[], type=_taint, metavar="KEY[=VALUE]:EFFECT",
                   help="a taint every node of this provider registers with (repeatable); reported on each "
                        "machine and forwarded by the shard to the UpcomingNode")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.seed_count < 0 or args.committed_count < 0:
        raise SystemExit("counts must be >= 0")
    rules: list[FaultRule] = []
    for c in args.fail_cluster:
        rules.append(FaultRule("fail", cluster=c, kinds=args.fault_kinds))
    for c in args.hang_cluster:
        rules.append(FaultRule("hang", cluster=c, kinds=args.fault_kinds))
    for kv in args.fail_label:
        rules.append(FaultRule("fail", label=kv, kinds=args.fault_kinds))
    for kv in args.hang_label:
        rules.append(FaultRule("hang", label=kv, kinds=args.fault_kinds))
    try:
        faults = FaultPlan(rules, args.fail_rate, args.fault_kinds, args.fault_seed)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    committed = tuple(t for t in COMMITTED if not args.cloud or t.cloud in args.cloud)
    elastic = tuple(t for t in ELASTIC if not args.cloud or t.cloud in args.cloud)
    if (args.committed_count and not committed) or (args.seed_count and not elastic):
        raise SystemExit(f"--cloud {','.join(args.cloud)}: no "
                         f"{'committed hosts' if args.committed_count and not committed else 'quota slots'} "
                         "to seed (onprem has committed bare metal only, gcp quota slots only; set that count to 0)")
    catalog = build_catalog(args.seed_count, args.committed_count, args.provider_name, elastic, committed)
    for inst in catalog:
        inst.taints = tuple(args.node_taint)
    backend = SimulatedCloud(
        catalog, args.provider_name,
        Dwell(args.create_delay, args.configure_delay, args.drain_delay, args.delete_delay), faults,
    )
    store = None
    if args.prebind_file:
        if args.state_file:
            raise SystemExit("--prebind-file and --state-file are exclusive")
        from bigfleet.provider.fake.seed import SeedStore, host_for, prebound_snapshot, read_seed

        try:
            bindings = read_seed(args.prebind_file)
            snap = prebound_snapshot(catalog, bindings, args.provider_name, args.require_zone)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--prebind-file: {exc}") from exc
        by_id = {inst.id: inst for inst in catalog}
        for b in bindings:  # the simulated substrate agrees: these hosts exist and are bound
            backend.hosts[b.machine_id] = host_for(by_id[b.machine_id], args.provider_name)
            backend.bindings[b.machine_id] = b.cluster
        store = SeedStore(snap)
    from bigfleet.provider.kit.server import KitOptions

    return run(backend, args, KitOptions(list_seed=args.list_seed), component="fake-provider", store=store)
