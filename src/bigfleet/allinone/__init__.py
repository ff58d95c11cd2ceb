"""`bigfleet all-in-one`: a whole fleet on one machine (real daemons, simulated clusters)."""
