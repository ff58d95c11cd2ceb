"""The coordinator: Raft-replicated fleet state (membership, placement, domains, instructions).

Shards use :mod:`bigfleet.coordclient.client` (``HeartbeatLoop``, ``InstructionHandler``);
operators use :func:`bigfleet.coordclient.client.lookup_cluster`.
"""
