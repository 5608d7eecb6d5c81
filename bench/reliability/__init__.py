"""Long-running faults: the soak (soak), the long form of tests/reliability."""
