"""tierstore: a tiered KV-cache store for LLM inference (HBM -> DRAM -> NVMe -> peers)."""

__version__ = "0.1.0"
