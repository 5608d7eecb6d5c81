"""``[remote]``: the remote persistent tier, an S3-compatible bucket below
NVMe: where, what goes there, uploads, lookups, deadlines, retries, GC.

Provides ``RemoteConfig``. Read by the sidecar's remote tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from tierstore.config.common import at_least, positive
from tierstore.errors import ConfigError


@dataclass(frozen=True)
class RemoteConfig:
    """The remote persistent tier: an S3-compatible bucket below NVMe."""

    remote_url: str = ""  # s3://bucket/prefix; empty disables the tier
    remote_endpoint: str = ""  # https://host:port of a non-AWS store (or AWS_ENDPOINT_URL)
    remote_region: str = ""  # region (or AWS_REGION); SeaweedFS/MinIO accept any
    remote_credentials_file: str = ""  # AWS shared-credentials file; else AWS_* variables
    remote_credentials_profile: str = "default"  # section of remote_credentials_file
    remote_bytes: int = 0  # budget; over it the oldest objects are deleted; 0: no GC here
    remote_gc_interval_s: float = 60.0  # how often one host checks the budget
    remote_gc_low_watermark: float = 0.9  # GC deletes down to this share of remote_bytes
    remote_gc_max_objects: int = 1_000_000  # objects listed per GC pass at most
    remote_gc_list_timeout_s: float = 60.0  # deadline of one GC pass's listing of the prefix
    remote_placement: str = "both"  # write_back | write_through | both (see operations.md)
    remote_min_tokens: int = 8192  # turns this long are written through at EndTurn
    remote_upload_queue_bytes: int = 256 << 20  # upload copies waiting or in flight
    remote_upload_concurrency: int = 8  # uploads in flight
    remote_write_through_queue_turns: int = 64  # turns waiting to be written through, per lane
    # (durable EndTurns, taken first; background write-throughs)
    remote_read_depth: int = 8  # GETs in flight while one request pulls blocks
    remote_lookup_concurrency: int = 64  # HEADs in flight in one lookup wave
    remote_lookup_window_blocks: int = 64  # blocks probed past the last manifest per wave
    remote_manifest_every_blocks: int = 64  # a write-through chain's manifest spacing
    remote_lookup_timeout_s: float = 1.0  # deadline of a remote prefix lookup
    remote_fetch_timeout_s: float = 30.0  # deadline of pulling a prefix into DRAM
    remote_durable_timeout_s: float = 30.0  # a durable EndTurn waits this long for the bucket
    remote_request_timeout_s: float = 10.0  # one request, its retries included
    remote_connect_timeout_s: float = 2.0  # TCP/TLS connect of one request
    remote_max_retries: int = 3  # retries of one request (5xx, SlowDown, dropped connections)
    remote_retry_backoff_s: float = 0.05  # first retry's backoff; doubles, with jitter
    remote_cache_keys: int = 1 << 16  # remembered answers (present / absent) of lookups
    remote_cache_ttl_s: float = 30.0  # a remembered answer is trusted this long
    remote_upload_give_up_s: float = 300.0  # a failing upload is retried this long
    remote_upload_backoff_s: float = 0.25  # a failed upload's first wait; doubles
    remote_upload_backoff_max_s: float = 5.0  # ... up to this
    remote_flush_on_close_s: float = 10.0  # close waits this long for queued uploads

    def __post_init__(self) -> None:
        if self.remote_url:
            if urlparse(self.remote_url).scheme != "s3":
                raise ConfigError(
                    f"remote_url must look like s3://bucket/prefix, got {self.remote_url!r}"
                )
        if self.remote_placement not in ("write_back", "write_through", "both"):
            raise ConfigError(
                "remote_placement must be write_back, write_through or both, "
                f"got {self.remote_placement!r}"
            )
        at_least(self, 0, "remote_bytes")
        if not 0.0 < self.remote_gc_low_watermark <= 1.0:
            raise ConfigError(
                f"remote_gc_low_watermark must be in (0, 1], got {self.remote_gc_low_watermark}"
            )
        at_least(
            self,
            1,
            "remote_gc_max_objects",
            "remote_min_tokens",
            "remote_upload_queue_bytes",
            "remote_upload_concurrency",
            "remote_write_through_queue_turns",
            "remote_read_depth",
            "remote_lookup_concurrency",
            "remote_lookup_window_blocks",
            "remote_manifest_every_blocks",
            "remote_cache_keys",
        )
        at_least(self, 0, "remote_max_retries")
        positive(
            self,
            "remote_gc_interval_s",
            "remote_lookup_timeout_s",
            "remote_fetch_timeout_s",
            "remote_durable_timeout_s",
            "remote_request_timeout_s",
            "remote_connect_timeout_s",
            "remote_retry_backoff_s",
            "remote_cache_ttl_s",
            "remote_upload_give_up_s",
            "remote_gc_list_timeout_s",
            "remote_upload_backoff_s",
        )
        at_least(self, 0, "remote_flush_on_close_s")
        if self.remote_upload_backoff_max_s < self.remote_upload_backoff_s:
            raise ConfigError(
                f"remote_upload_backoff_max_s ({self.remote_upload_backoff_max_s}) must be at "
                f"least remote_upload_backoff_s ({self.remote_upload_backoff_s})"
            )
