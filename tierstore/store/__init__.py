"""The store inside the sidecar: the data plane.

``tiered`` (``TieredStore``: the only module that knows more than one tier)
and what it is built from (``build``): ``promoter`` (NVMe -> DRAM promotion
with several reads in flight), ``demoter`` (DRAM's victims and their spill),
``writer`` (write-through to NVMe, drain), ``hasher`` and ``digests`` (each
block hashed once), ``base`` (the tier protocol), one module per tier
(``dram``; ``nvme`` with ``nvme_index``, ``nvme_batch`` and ``blockfile``;
``remote`` with ``remote_format``, ``remote_client``, ``remote_upload``,
``remote_gc``, ``remote_cache``, ``remote_pull`` and ``remote_source``), the
``replicas`` ledger, the ``events`` log of tier changes, ``stat``, and small
types (``layouts``, ``buffers``, ``results``).

Runs in the sidecar process only; engines never import it (it pulls lmdb).
"""

from tierstore.store.tiered import STORE_OWNER, LookupResult, Reservation, TieredStore

__all__ = ["STORE_OWNER", "LookupResult", "Reservation", "TieredStore"]
