"""The store inside the sidecar: the data plane.

``tiered`` (``TieredStore``: the only module that knows more than one tier)
and what it is built from (``build``): ``reserve`` (a batch's DRAM slots),
``promoter`` (NVMe -> DRAM promotion with several reads in flight),
``demoter`` (DRAM's victims and their spill), ``hasher`` and ``digests``
(each block hashed once), ``base`` (the tier protocol), the DRAM tier
(``dram``, its pins by owner in ``pins``), the ``replicas`` ledger, the
``events`` log of tier changes, ``stat``, and small types (``layouts``,
``buffers``, ``results``). The two tiers below DRAM are folders, each opened
by a docstring that names the seam the rest of the store uses:

- ``nvme/``: the NVMe tier (``tier``, ``index``, ``batch``, ``reads``,
  ``full``, ``blockfile``) and the write-through ``writer``;
- ``remote/``: the S3 tier (``tier``, ``client``, ``upload``, ``turns``,
  ``pull``, ``gc``, ``cache``, ``format``, ``source``).

Runs in the sidecar process only; engines never import it (it pulls lmdb).
"""

from tierstore.store.tiered import STORE_OWNER, LookupResult, Reservation, TieredStore

__all__ = ["STORE_OWNER", "LookupResult", "Reservation", "TieredStore"]
