"""The remote tier against a real SeaweedFS (tier)."""
