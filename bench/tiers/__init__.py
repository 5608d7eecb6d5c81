"""The local tiers next to this machine's limits: DRAM and NVMe throughput
(local), cost per block against blocks held (scale), restart (restart), memory
that sat idle (memage) and the engine client against a real sidecar (client).
"""
