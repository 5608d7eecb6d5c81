"""``[store]``: the tiered store (DRAM arena over NVMe): sizes, watermarks,
policies by name, the write-through queue, the NVMe index reserve.

Provides ``StoreConfig``. Read by the sidecar (and by tests and benches
that build a store in-process).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierstore.config.common import at_least, default_cache_dir, positive
from tierstore.errors import ConfigError
from tierstore.policies.write import WRITE_POLICIES


@dataclass(frozen=True)
class StoreConfig:
    """The tiered store (DRAM arena over NVMe)."""

    dram_bytes: int = 1 << 30  # size of the shared-memory arena
    dram_segment_bytes: int = 16 << 20  # arena unit handed to one block size
    dram_high_watermark: float = 0.90  # share of the arena used that wakes the demoter
    dram_low_watermark: float = 0.75  # the demoter spills until usage is below this share
    shm_dir: str = "/dev/shm"  # tmpfs directory holding the arena file
    nvme_dir: str = field(default_factory=lambda: str(default_cache_dir() / "nvme"))
    nvme_bytes: int = 16 << 30  # budget of the NVMe tier; 0 disables the tier
    nvme_segment_bytes: int = 64 << 20  # block-file unit handed to one block size
    nvme_direct_io: bool = True  # O_DIRECT when the filesystem allows it
    eviction_policy: str = "lru"  # lru | s3fifo, for DRAM and NVMe
    nvme_admission: str = "always"  # always | seen_twice: which evicted blocks are spilled
    demote_batch_blocks: int = 32  # blocks spilled per NVMe write batch (one fsync)
    demote_batch_bytes: int = 128 << 20  # and at most this many bytes (writers wait one batch)
    promote_wait_s: float = 10.0  # longest wait for another thread's promotion of a block
    demoter_poll_s: float = 1.0  # the demoter re-checks DRAM usage at least this often
    nvme_read_depth: int = 4  # NVMe reads in flight while one request promotes blocks
    event_log_keys: int = 1 << 18  # tier changes kept for routers' WatchBlocks streams (keys)
    write_policy: str = "write_back"  # write_back | write_through | write_through_selective
    write_queue_bytes: int = 256 << 20  # bound of the write-through queue (what a crash may lose)
    write_through_min_tokens: int = 8192  # write_through_selective: turns this long are written
    nvme_index_reserve_bytes: int = 0  # disk kept free for the LMDB index; 0: derived
    nvme_full_backoff_s: float = 5.0  # after ENOSPC, re-check the disk this often (doubling)
    dram_populate: str = "background"  # background (serve at once) | upfront (populate first)
    dram_ready_bytes: int = 256 << 20  # background: arena bytes made ready before serving
    dram_huge_pages: bool = True  # ask for transparent huge pages on the arena (madvise)
    dram_lock: str = "auto"  # lock the arena's pages in memory: auto (warn if not) | require | off
    hash_queue_blocks: int = 1 << 16  # committed blocks waiting for their digest; 0: hash on use
    replica_live_s: float = 300.0  # replicas pushed this recently keep their LRU place in DRAM

    def __post_init__(self) -> None:
        if self.dram_bytes <= 0:
            raise ConfigError(f"dram_bytes must be positive, got {self.dram_bytes}")
        at_least(self, 0, "nvme_bytes")
        at_least(self, 0, "dram_ready_bytes")
        if not 0.0 < self.dram_low_watermark < self.dram_high_watermark <= 1.0:
            raise ConfigError(
                "watermarks must satisfy 0 < dram_low_watermark < dram_high_watermark <= 1, "
                f"got low={self.dram_low_watermark} high={self.dram_high_watermark}"
            )
        at_least(self, 1, "demote_batch_blocks")
        at_least(self, 1, "demote_batch_bytes")
        at_least(self, 1, "nvme_read_depth")
        positive(self, "promote_wait_s")
        positive(self, "demoter_poll_s")
        at_least(self, 1, "event_log_keys")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(
                f"write_policy must be one of {', '.join(WRITE_POLICIES)}, "
                f"got {self.write_policy!r}"
            )
        at_least(self, 1, "write_queue_bytes")
        at_least(self, 1, "write_through_min_tokens")
        at_least(self, 0, "nvme_index_reserve_bytes")
        positive(self, "nvme_full_backoff_s")
        if self.dram_lock not in ("auto", "require", "off"):
            raise ConfigError(f"dram_lock must be auto, require or off, got {self.dram_lock!r}")
        if self.dram_populate not in ("background", "upfront"):
            raise ConfigError(
                f"dram_populate must be background or upfront, got {self.dram_populate!r}"
            )
        at_least(self, 0, "replica_live_s")
        at_least(self, 0, "hash_queue_blocks")
