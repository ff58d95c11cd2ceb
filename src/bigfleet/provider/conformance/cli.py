"""`bigfleet conformance`: certify a capacity provider against the contract.

    bigfleet conformance --target 127.0.0.1:9400
    bigfleet conformance --lanes core,fault,durability,scale \\
        --provider-cmd "bigfleet fake-provider --listen {listen} --state-file {state_file} --seed-count {seed_count}"

Over mTLS (``--tls-cert/--tls-key/--tls-ca``, all three or none) the suite dials the provider with that
certificate. A provider that pins shard certificates to the fenced ``shard_id`` (as the provider kit
does) needs ``--tls-ca-key`` too: the suite then issues a short-lived shard certificate for every shard id
it fences with.

Exits 0 when no check failed (skips do not fail the run unless --strict).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bigfleet.provider.conformance.checks import REGISTRY
from bigfleet.provider.conformance.dialer import Transport
from bigfleet.provider.conformance.runner import LANES, Params, Result, print_table, run_suite, write_junit
from bigfleet.security import add_tls_arguments, tls_from_args_or_exit


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bigfleet conformance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="", help="HOST:PORT of a running provider (core and scale lanes)")
    p.add_argument("--lanes", default="core", help=f"comma-separated lanes out of {','.join(LANES)} (default core)")
    p.add_argument("--provider-cmd", default="",
                   help="command line that starts the provider; placeholders {listen} {host} {port} {state_file} "
                        "{seed_count}. Needed by the fault and durability lanes")
    p.add_argument("--junit", default="", help="write JUnit XML here")
    p.add_argument("--only", default="", help="comma-separated check ids to run (e.g. C201,C202)")
    p.add_argument("--strict", action="store_true", help="a skipped check fails the run")
    p.add_argument("--workdir", default="", help="where launched providers keep logs and state (default a temp dir)")
    p.add_argument("--scale-machines", type=int, default=5000, help="machines the scale lane expects (default 5000)")
    p.add_argument("--scale-burst", type=int, default=256, help="concurrent Creates in the scale burst")
    p.add_argument("--list-budget", type=float, default=5.0, help="seconds allowed for a full List in scale")
    p.add_argument("--rpc-budget-ms", type=float, default=250.0, help="p99 budget for Get and Create acks in scale")
    p.add_argument("--fault-timeout", type=float, default=2.0,
                   help="transition timeout the fault lane asks of the provider (BIGFLEET_CONFORMANCE_TRANSITION_"
                        "TIMEOUT)")
    p.add_argument("--settle-timeout", type=float, default=15.0, help="seconds a transition may take to settle")
    p.add_argument("--quiet", action="store_true", help="print only the final table")
    add_tls_arguments(p)
    p.add_argument("--tls-ca-key", default="",
                   help="PEM key of --tls-ca: issue a shard certificate per fenced shard id (needs --tls-*)")
    return p


def only_problem(only: set[str] | None, lanes: list[str]) -> str:
    """Why ``--only`` cannot be honoured ("" if it can): a run that selects no check would print
    "0 passed, 0 failed" and exit 0, which reads as a pass."""
    if not only:
        return ""
    lane_of = {c.id: c.lane for c in REGISTRY}
    unknown = sorted(only - lane_of.keys())
    if unknown:
        return f"unknown check id(s) {unknown} in --only (ids look like C101, F601, D701, S801)"
    outside = sorted(i for i in only if lane_of[i] not in lanes)
    if outside:
        wanted = sorted({lane_of[i] for i in outside})
        return (f"--only {outside} belong to lane(s) {wanted}, not to --lanes {','.join(lanes)}; "
                f"add them to --lanes")
    return ""


def main(argv: list[str]) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    tls = tls_from_args_or_exit(ap, args)
    if args.tls_ca_key and tls is None:
        ap.error("--tls-ca-key needs --tls-cert, --tls-key and --tls-ca")
    if args.tls_ca_key and not Path(args.tls_ca_key).is_file():
        ap.error(f"--tls-ca-key {args.tls_ca_key!r} is not a readable file")
    lanes = [lane.strip() for lane in args.lanes.split(",") if lane.strip()]
    unknown = [lane for lane in lanes if lane not in LANES]
    if unknown:
        print(f"bigfleet conformance: unknown lane(s) {unknown}; lanes are {', '.join(LANES)}", file=sys.stderr)
        return 2
    if not args.target and not args.provider_cmd:
        print("bigfleet conformance: give --target HOST:PORT and/or --provider-cmd", file=sys.stderr)
        return 2
    params = Params(
        fault_timeout=args.fault_timeout, scale_machines=args.scale_machines, scale_burst=args.scale_burst,
        list_budget=args.list_budget, rpc_budget=args.rpc_budget_ms / 1000.0, settle_timeout=args.settle_timeout,
        transport=Transport(tls, Path(args.tls_ca_key) if args.tls_ca_key else None),
    )

    def progress(r: Result) -> None:
        if not args.quiet:
            print(f"  {r.lane:<11} {r.id:<6} {r.status.upper():<5} {r.seconds:6.2f}s  {r.title}", file=sys.stderr,
                  flush=True)

    only = {x.strip().upper() for x in args.only.split(",") if x.strip()} or None
    problem = only_problem(only, lanes)
    if problem:
        print(f"bigfleet conformance: {problem}", file=sys.stderr)
        return 2
    results = run_suite(args.target or None, lanes, args.provider_cmd or None, params,
                        Path(args.workdir) if args.workdir else None, only, progress)
    print_table(results, sys.stdout)
    if args.junit:
        write_junit(results, args.junit)
    failed = any(r.status == "fail" for r in results)
    skipped = any(r.status == "skip" for r in results)
    return 1 if failed or (args.strict and skipped) else 0
