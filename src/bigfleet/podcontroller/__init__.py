"""The optional pod controller: one CapacityRequest per unschedulable pod."""
