"""The store inside the sidecar: the data plane.

``tiered`` (``TieredStore``: the only module that knows more than one tier),
``promoter`` (NVMe -> DRAM promotion with several reads in flight),
``base`` (the tier protocol), one module per tier (``dram``; ``nvme`` with
``nvme_index``, ``nvme_batch`` and ``blockfile``), the ``replicas`` ledger
and the ``events`` log of tier changes.

Runs in the sidecar process only; engines never import it (it pulls lmdb).
"""

from tierstore.store.tiered import STORE_OWNER, LookupResult, Reservation, TieredStore

__all__ = ["STORE_OWNER", "LookupResult", "Reservation", "TieredStore"]
