"""A TierstoreConnector that also writes its KVLayouts to a file (tests only).

``LayoutProbeConnector`` is the production connector, unchanged, plus one
JSON write at construction: the layouts (one per tensor-parallel rank) that
its keys are chained under, to ``$TIERSTORE_TEST_LAYOUT_PATH``. With them a
test computes the very keys the engine will look up, and so can put bytes of
its choosing under them through a plain ``StoreClient`` (the negative
control of ``test_vllm.py``). Nothing in the package can do that: it lives
here, and an engine only gets it by naming this module in its
``kv_connector_module_path``.

Runs in vLLM's scheduler and worker processes (both write the same layouts).
"""

from __future__ import annotations

import json
import os
from typing import Any

from tierstore.engines.vllm import TierstoreConnector

LAYOUT_PATH_ENV = "TIERSTORE_TEST_LAYOUT_PATH"  # test_vllm.py names it too (it imports no vLLM)


class LayoutProbeConnector(TierstoreConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        path = os.environ.get(LAYOUT_PATH_ENV)
        if path and self.disabled is None:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump([layout.to_dict() for layout in self.layouts], f)
            os.replace(tmp, path)
