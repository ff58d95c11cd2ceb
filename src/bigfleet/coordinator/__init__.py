"""The coordinator: Raft-replicated fleet state (membership, placement, domains, instructions).

Shards use :mod:`bigfleet.coordinator.client` (``HeartbeatLoop``, ``InstructionHandler``);
operators use :func:`bigfleet.coordinator.client.lookup_cluster`.
"""
