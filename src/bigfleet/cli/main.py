"""`bigfleet` entry point: one binary, one subcommand per daemon or tool.

Each subcommand lives in its own module exposing ``main(argv) -> int`` and is
imported only when chosen, so a daemon's start-up never pays for the others.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

# name -> (module, one-line description)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "shard": ("bigfleet.shard.cli", "run a shard: Session server, decision cycles, provider execution"),
    "coordinator": ("bigfleet.coordinator.cli", "run a coordinator replica (Raft fleet state)"),
    "operator": ("bigfleet.operator.cli", "run the per-cluster operator (CapacityRequests -> Session)"),
    "pod-controller": ("bigfleet.podcontroller.cli", "write a CapacityRequest for each unschedulable pod"),
    "fake-provider": ("bigfleet.provider.fake.cli", "run the simulated-cloud capacity provider"),
    "conformance": ("bigfleet.provider.conformance.cli", "certify a capacity provider against the contract"),
    "all-in-one": ("bigfleet.allinone.cli", "a whole fleet on this machine: coordinator, shard, provider, clusters"),
    "scaletest": ("bigfleet.scale.cli", "load a real shard at scale and report cycle and roll-up latencies"),
}


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = ["usage: bigfleet <subcommand> [options]", "", "subcommands:"]
    for name, (_, desc) in SUBCOMMANDS.items():
        lines.append(f"  {name.ljust(width)}  {desc}")
    lines += ["", "Run `bigfleet <subcommand> --help` for the options of one subcommand."]
    return "\n".join(lines)


def _load(name: str) -> Callable[[list[str]], int] | None:
    module_name, _ = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return None
        raise
    fn: Callable[[list[str]], int] = module.main
    return fn


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("--version", "version"):
        from bigfleet import __version__

        print(f"bigfleet {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"bigfleet: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    fn = _load(name)
    if fn is None:
        print(f"bigfleet {name}: not available in this build yet", file=sys.stderr)
        return 2
    return int(fn(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
