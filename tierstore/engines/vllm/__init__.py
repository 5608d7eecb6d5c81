"""tierstore's vLLM KV connector, one module per side of it.

vLLM loads the connector by module path and class name::

    "kv_connector": "TierstoreConnector", "kv_connector_module_path": "tierstore.engines.vllm"

- ``connector``: ``TierstoreConnector``, the ``KVConnectorBase_V1`` vLLM builds;
- ``layout``: settings and the ``KVLayout`` per tensor-parallel rank;
- ``plan``: the scheduler side (what to load and save each step);
- ``worker``, ``loader``: one step's loads and saves, background loads;
- ``pages``, ``cuda``: vLLM's pages and their copies, on the CPU and on CUDA;
- ``link``: the sidecar connection with deadlines;
- ``metrics``, ``events``: vLLM's connector stats and KV events;
- ``driver``, ``demo``: a vLLM engine in a child process, and ``tierstore demo --vllm``.

The connector class is imported on first use, so that importing a pure
module (``plan``, ``layout``) does not pull in vLLM's connector base.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierstoreConnector", "TierstoreConnectorMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tierstore.engines.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
