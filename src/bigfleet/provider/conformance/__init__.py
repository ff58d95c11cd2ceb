"""The provider conformance suite: certify any provider, in any language, over the wire."""

from bigfleet.provider.conformance.runner import LANES, Params, Result, run_suite

__all__ = ["LANES", "Params", "Result", "run_suite"]
