"""Conversions between the generated protos (`bigfleet.v1alpha1`) and the pure domain types.

`bigfleet.needs`, `bigfleet.machine` and `bigfleet.decision` never import protos, gRPC or asyncio
(an import-linter contract, see docs/architecture.md); everything that touches the wire lives here:
`bigfleet.wire.needs` (demand, `capacity.proto`) and `bigfleet.wire.machine` (provider `Machine`,
shard_metadata keys).
"""
