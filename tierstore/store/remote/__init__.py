"""The remote persistent tier: one verified object per block in an
S3-compatible bucket, shared by every host of the group.

The rest of the store sees ``tier.RemoteTier`` (lookups, verified reads,
``offer`` / ``end_turn`` for uploads, ``stats``) and two helpers the tiered
store hands its own parts to: ``pull.pull_prefix`` (bucket -> DRAM) and
``source.HeldBlockSource`` (DRAM or NVMe -> upload). Behind the tier:

- ``client``: the S3 calls, on one obstore event-loop thread;
- ``upload``: the bounded background uploader, ``turns`` its durability
  record of finished turns;
- ``gc``: garbage collection under ``remote_bytes``;
- ``cache``: what this host remembers of the bucket (lookup answers, last use);
- ``format``: an object's bytes and name, pure encoding and verification.

Runs in the sidecar process only.
"""
