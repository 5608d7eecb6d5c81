"""Policies: pure objects, no I/O, no locks, no torch; one module per kind.

- ``eviction``: the order in which a tier gives up blocks (``LruPolicy``,
  the default, and ``S3FifoPolicy``), behind ``EvictionPolicy``;
- ``admission``: whether an evicted block is written to the slower tier at
  all (``AlwaysAdmit``, ``SeenTwiceAdmit``);
- ``write``: which DRAM blocks are written to NVMe before they are evicted
  (``WriteBack``, ``WriteThrough``, ``WriteThroughSelective``);
- ``replication``: the spill host of a session (rendezvous hashing, the
  target of kv_share's pushes), whether a push is made (``KvShareRule``,
  ``HeadroomRule``), and which replicas leave DRAM first (``ReplicaRetention``);
- ``remote``: what the remote tier receives (``RemotePlacement``) and what
  its garbage collection deletes (``remote_gc_victims``);
- ``compression``: whether a peer transfer is compressed
  (``compress_transfer``), from the rates measured each way.

Each kind has a ``make_*`` factory by config name where the config picks one.
The tier or service that owns a policy serialises every call (its own lock):
policies hold no lock and are unit-tested in milliseconds.
"""
