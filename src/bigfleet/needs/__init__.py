"""Demand: resource vectors, requirements, penalty buckets, profiles, needs and the NeedsTable.

Pure (no I/O, no clock reads): time is always passed in. Import everything from here; the proto
conversions are in `bigfleet.wire.needs`.
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
    "parse_quantity",
    "penalty_sort_key",
    "snapshot_sort_key",
]
