"""BigFleet: a fleet-level infrastructure autoscaler for Kubernetes."""

__version__ = "0.1.0"
