"""Demand: resource vectors, requirements, penalty buckets, profiles, needs and the NeedsTable.

Pure (no I/O, no clock reads): time is always passed in. Import everything from here.
"""

from bigfleet.needs.errors import ValidationError
from bigfleet.needs.penalty import (
    MAX_FINITE_DOLLARS,
    PenaltyBucket,
    bucket_dollars,
    bucket_from_dollars,
    dollars_sort_key,
    penalty_sort_key,
)
from bigfleet.needs.profile import FINGERPRINT_VERSION, Need, Profile, merge_needs
from bigfleet.needs.quantity import MAX_MILLI, format_quantity, parse_quantity
from bigfleet.needs.requirements import (
    MAX_LABEL_KEY_LEN,
    MAX_LABEL_VALUE_LEN,
    Operator,
    Requirement,
    TopologySpread,
    WhenUnsatisfiable,
    matches_all,
)
from bigfleet.needs.resources import EMPTY, Resources
from bigfleet.needs.table import NeedsTable, snapshot_sort_key
from bigfleet.needs.wire import (
    need_from_proto,
    need_to_proto,
    profile_from_proto,
    requirement_from_proto,
    requirement_to_proto,
    requirements_from_proto,
    rollup_from_proto,
    rollup_to_proto,
    spread_from_proto,
    spread_to_proto,
    validate_cluster_id,
    validate_group,
)

EMPTY_RESOURCES = EMPTY

__all__ = [
    "EMPTY",
    "EMPTY_RESOURCES",
    "FINGERPRINT_VERSION",
    "MAX_FINITE_DOLLARS",
    "MAX_LABEL_KEY_LEN",
    "MAX_LABEL_VALUE_LEN",
    "MAX_MILLI",
    "Need",
    "NeedsTable",
    "Operator",
    "PenaltyBucket",
    "Profile",
    "Requirement",
    "Resources",
    "TopologySpread",
    "ValidationError",
    "WhenUnsatisfiable",
    "bucket_dollars",
    "bucket_from_dollars",
    "dollars_sort_key",
    "format_quantity",
    "matches_all",
    "merge_needs",
    "need_from_proto",
    "need_to_proto",
    "parse_quantity",
    "penalty_sort_key",
    "profile_from_proto",
    "requirement_from_proto",
    "requirement_to_proto",
    "requirements_from_proto",
    "rollup_from_proto",
    "rollup_to_proto",
    "snapshot_sort_key",
    "spread_from_proto",
    "spread_to_proto",
    "validate_cluster_id",
    "validate_group",
]
