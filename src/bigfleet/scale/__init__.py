"""Scale harness: real shard(s), fake provider(s), coordinator and a multi-process Session load generator."""
