"""`bigfleetctl`: the admin CLI over the coordinator and ShardRead APIs."""

from __future__ import annotations

import sys
from collections.abc import Sequence

COMMANDS = [
    ("shards", "list registered shards and their last heartbeat"),
    ("clusters", "list cluster -> shard bindings"),
    ("domains", "assign|unassign topology domains to shards"),
    ("needs", "show a cluster's needs and the engine's verdicts"),
    ("inventory", "show a shard's inventory by state"),
    ("shortfalls", "show unmet demand"),
    ("rebalance", "--plan|--apply cluster moves between shards"),
    ("pause", "pause a shard's decisions"),
    ("resume", "resume a shard's decisions"),
    ("snapshot", "save a coordinator snapshot"),
    ("raft", "join a replica to the coordinator's Raft group"),
    ("certs", "make a CA and per-role certificates for local use"),
]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    print("usage: bigfleetctl <command> [options]\n\ncommands:")
    for name, desc in COMMANDS:
        print(f"  {name.ljust(11)} {desc}")
    return 0 if not args or args[0] in ("-h", "--help") else 2


if __name__ == "__main__":
    raise SystemExit(main())
