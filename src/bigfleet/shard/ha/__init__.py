"""Shard high availability (issue #6): a Raft-replicated NeedsTable, epoch and carried engine state,
with only the leader running cycles, calling the provider and serving Sessions."""
