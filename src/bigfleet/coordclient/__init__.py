"""The coordinator's client library: leader-following RPCs, the shard heartbeat loop and
instruction handling, cluster lookups (`bigfleet.coordclient.client`).

Shared by the shard, `bigfleetctl`, the scale harness and the tests; it depends on the generated
protos only, never on the coordinator's server side, so `bigfleet.shard` need not import
`bigfleet.coordinator` (an import-linter contract, see docs/architecture.md).
"""
