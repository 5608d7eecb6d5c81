"""A TierstoreConnector that leaves the sliding-window groups out of its
loads (tests only): the negative control of ``test_vllm_hybrid.py``.

``WindowSkippingConnector`` is the production connector with one change:
its worker copies no block into a sliding-window group's pages (each such
group's block ids are replaced by vLLM's null block, which the worker
skips), so those layers see whatever their window's blocks held. Greedy
ids that then differ from vLLM alone's say the test's equal ids needed the
window's KV. An engine only gets it by naming this module in its
``kv_connector_module_path``.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_cache_interface import SlidingWindowSpec

from tierstore.engines.vllm import TierstoreConnector
from tierstore.engines.vllm.plan import NULL_BLOCK_ID


class WindowSkippingConnector(TierstoreConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self.worker is None:
            return
        sliding = {
            g
            for g, group in enumerate(kv_cache_config.kv_cache_groups)
            if isinstance(group.kv_cache_spec, SlidingWindowSpec)
        }
        to_pages = self.worker._to_pages

        def full_groups_only(mover: Any, offsets: Any, ids: Any) -> None:
            skipped = tuple(
                (NULL_BLOCK_ID,) * len(g) if i in sliding else g for i, g in enumerate(ids)
            )
            to_pages(mover, offsets, skipped)

        self.worker._to_pages = full_groups_only  # type: ignore[method-assign]
