"""Whether a peer transfer goes over byte-split zstd (``compression = "auto"``).

Provides ``compress_transfer``: a pure rule over three measured rates. It
runs in the sidecar, on the thread that opens a fetch.

Compression pays when the wire is the bottleneck and the CPU is not. The
codec's speed is measured once at start (an idle host), the link's on each
large raw transfer (a busy one: the same CPU that would compress also
receives, verifies and runs the engines). Comparing the two alone turned
compression on exactly when a host was busiest: a transfer slowed by the
CPU read as a slow link, and compressing it on that CPU made it slower
still (a fleet's moved turns waited seconds on 8 blocks). So once a
compressed transfer has been timed, the rule compares like with like: the
bytes each way delivered per second, measured on this host as it is now.
"""

from __future__ import annotations


def compress_transfer(
    raw_bytes_per_s: float,
    packed_bytes_per_s: float,
    codec_bytes_per_s: float,
    probe: bool,
) -> bool:
    """Compress the next transfer from a peer?

    ``raw_bytes_per_s``: raw transfers from that peer (0: none timed yet);
    ``packed_bytes_per_s``: compressed ones, in uncompressed bytes delivered
    per second (0: none timed yet); ``codec_bytes_per_s``: this host's
    compression speed, measured at start; ``probe``: this transfer
    re-measures the way not preferred now, so both rates stay current (a
    rate goes stale only for a way worth trying: a link faster than the
    codec never gains from compression and is never probed with it)."""
    if raw_bytes_per_s <= 0:
        return False  # time the link raw first
    worth_trying = raw_bytes_per_s < codec_bytes_per_s
    if packed_bytes_per_s <= 0:
        prefer = worth_trying
    else:
        prefer = packed_bytes_per_s > raw_bytes_per_s
    if probe:
        return not prefer and worth_trying
    return prefer
