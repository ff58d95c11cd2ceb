"""The shard daemon: Session server, decision cycles, fenced provider execution, reconcile."""
