"""The block keys of a prompt, derived as the engine's connector derives them.

Provides ``prompt_keys(layout, token_ids, cache_salt)``. The layout is the
one the engine's connector registered with its sidecar (the gateway reads
it from the sidecar's ``PeerStat``), so its model string says which
engine's scheme applies:

- ``sglang:...`` (``tierstore.engines.sglang``): SGLang's own page hashes
  (``engines.sglang.keys.page_hashes``), mapped into the layout's namespace
  by ``block_keys``, as the HiCache backend maps them;
- ``vllm:...`` (``tierstore.engines.vllm``), and a layout given in the
  gateway's config: ``chain_keys`` over the prompt's full blocks; a
  request's ``cache_salt`` joins the layout's tenant salt exactly as the
  connector's ``request_salt`` does.

Pure functions (no torch, no engine import); any thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tierstore.engines.sglang.keys import block_keys, page_hashes
from tierstore.engines.vllm.layout import salted
from tierstore.keys import BlockKey, KVLayout, chain_keys


def prompt_keys(layout: KVLayout, token_ids: Sequence[int], cache_salt: str = "") -> list[BlockKey]:
    """One key per full block of ``token_ids`` under ``layout``."""
    if layout.model.startswith("sglang:"):
        return block_keys(layout, page_hashes(token_ids, layout.block_tokens))
    if cache_salt:
        layout = replace(layout, tenant_salt=salted(layout.tenant_salt, cache_salt))
    return chain_keys(layout, token_ids)
