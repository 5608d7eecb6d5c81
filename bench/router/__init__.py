"""The router's decisions over real sidecars on loopback (decisions)."""
