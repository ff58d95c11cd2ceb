"""BigFleet capacity provider for AWS EC2 (``bigfleet-provider-aws``), built on ``bigfleet.provider.kit``."""

__version__ = "0.1.0"
