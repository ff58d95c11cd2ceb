"""The fake provider: the kit over a simulated multi-cloud catalog with dwell times and faults."""
