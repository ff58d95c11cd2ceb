"""Capacity providers: the kit authors build on, the simulated cloud, and the conformance suite."""
