"""The NVMe tier: KV blocks in one data file on local disk, indexed by LMDB.

The rest of the store sees one class, ``tier.NvmeTier`` (the ``Tier``
protocol of ``tierstore.store.base``: ``contains``, ``meta``, ``write_many``,
``read_into``, ``remove``, ``stats``), and the tiered store's write-through
writer, ``writer.NvmeWriter``. Beside them, without state of their own:

- ``index``: the directory, its lock and the LMDB index (``open_root``);
- ``batch``: a write batch's items, digests and victim order;
- ``blockfile``: aligned O_DIRECT reads and writes of the data file;

and two pieces of the tier's state, each serving one concern of it:

- ``reads``: the pins on slots being read, and the verified read of a block;
- ``full``: the cap while the filesystem is full, and when to look again.

Data is durable before its index row commits; every read is verified
against its blake3 digest. Runs in the sidecar process only.
"""
