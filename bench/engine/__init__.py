"""Shape generators for the decision-engine benchmarks (also used by tests at small sizes)."""
