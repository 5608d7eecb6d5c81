"""HuggingFace transformers adapter: store a causal LM's KV cache, resume warm.

Provides ``HFStoreAdapter``: ``save`` after a prefill, ``resume`` (load the
longest stored prefix, prefill the rest), ``prefill`` (cold), ``generate``
(greedy), ``end_turn``; it warns (``InexactAttentionWarning``) when the
model's attention is not eager, as results are then close, not bitwise.
``ResumeResult`` and ``GenerateResult`` are what they return.

The rest of the package, a module each: ``model`` (``check_supported``,
``UnsupportedModelError``, ``model_identity``, ``layout_for``: what a model
is, as tierstore sees it) and ``cache`` (``pack_blocks`` /
``unpack_blocks``: a DynamicCache <-> block bytes, and their byte layout).

Exactness (measured with transformers 5.24 and 5.19, torch 2.13 CPU, MKL on AVX2):
a resume recomputes at least ``min_compute_tokens`` (default 16) tokens
because GEMM kernels are not batch-invariant for very few rows: MKL sgemm
takes another kernel below 12 rows (torch's bmm below 4), so the rows of a
1-11 token suffix differ from the same rows of a full prefill by about one
float32 ulp. With at least 12 rows every row is bitwise that of the full
prefill, so with ``attn_implementation="eager"`` the last logits of a resume
equal a cold prefill's exactly (torch.equal) in float32, float16 and
bfloat16, and so does every K/V row of the cache. The sdpa CPU kernel splits
queries into tiles of 32, 64 or 256 rows (by length): when a cold prefill's
last tile has 1-3 rows, float32 logits of a resume differ from it by about
1e-7 (float16/bfloat16: equal as measured). The rule costs at most one block.
Measured bitwise with eager attention: Llama, Qwen2, GPT-2 (learned absolute
positions), GPT-NeoX (partial rotary), Falcon and GPT-BigCode (multi-query),
Phi, OPT, Gemma, Bloom (ALiBi), GPT-J.

Runs in the engine process, on the thread that runs the model. An adapter
is not thread-safe (neither is the model's cache); the StoreClient is.
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierstore.client import StoreClient
from tierstore.engines.hf.cache import fill_layer, out_cache, pack_blocks, unpack_blocks
from tierstore.engines.hf.model import check_supported, kv_shape, layout_for
from tierstore.errors import LayoutError
from tierstore.keys import BlockKey, KVLayout, chain_keys
from tierstore.tiers import TierName

_CACHE_PARAM_NAMES = ("cache", "past_key_values")  # transformers >= 5.x, before


TokenIds = Sequence[int] | torch.Tensor | np.ndarray


def _as_ids(token_ids: TokenIds) -> torch.Tensor:
    """A prompt as a non-empty 1-D int64 CPU tensor."""
    ids = torch.as_tensor(
        token_ids if isinstance(token_ids, torch.Tensor) else np.asarray(token_ids)
    )
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError(
            f"token_ids must be a non-empty 1-D sequence, got shape {tuple(ids.shape)}"
        )
    return ids.to(torch.long).cpu()


class InexactAttentionWarning(UserWarning):
    """The model's attention is not ``eager``: a warm resume is close to a cold
    prefill (about 1e-7 in float32 with sdpa), not bitwise equal."""


def _warn_unless_eager(model: Any) -> None:
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    if attn != "eager":
        warnings.warn(
            f"attn_implementation={attn!r}: a warm resume's logits can differ from a cold "
            "prefill's in the last bits (sdpa: about 1e-7 in float32); load the model with "
            "attn_implementation='eager' for bitwise-equal results",
            InexactAttentionWarning,
            stacklevel=3,
        )


@dataclass(frozen=True, slots=True)
class ResumeResult:
    """A prefill that may have reused stored blocks.

    ``logits`` are those of the last prompt position (float, shape [vocab]);
    ``cache`` holds the KV of the whole prompt; ``tiers[i]`` is where reused
    block ``i`` came from. ``store_s`` is lookup + load, ``restore_s`` the
    copy of loaded blocks into the cache, ``model_s`` the forward pass.
    """

    logits: torch.Tensor
    cache: Any
    num_tokens: int
    num_reused_tokens: int
    tiers: tuple[TierName, ...]
    store_s: float
    restore_s: float
    model_s: float

    @property
    def num_computed_tokens(self) -> int:
        return self.num_tokens - self.num_reused_tokens


@dataclass(frozen=True, slots=True)
class GenerateResult:
    tokens: list[int]  # the generated ids, prompt excluded
    prompt: ResumeResult
    cache: Any  # KV of the prompt and of every generated token but the last


class HFStoreAdapter:
    """Save and restore the KV cache of one transformers causal LM (batch 1).

    ``min_compute_tokens``: a resume reuses at most ``len(tokens) -
    min_compute_tokens`` tokens, rounded down to whole blocks (at least one
    token is always computed: its logits are the result). See the module
    docstring for why 16 keeps float32 results bitwise; 1 maximises reuse.
    """

    def __init__(
        self,
        model: Any,
        client: StoreClient,
        layout: KVLayout | None = None,
        *,
        min_compute_tokens: int = 16,
    ) -> None:
        check_supported(model.config)
        _warn_unless_eager(model)
        self.model = model
        self.client = client
        self.layout = layout or layout_for(model)
        if self.layout.tp_size != 1:
            raise LayoutError(
                "HFStoreAdapter runs the whole model in one process: tp_size must be 1"
            )
        if min_compute_tokens < 1:
            raise ValueError(f"min_compute_tokens must be at least 1, got {min_compute_tokens}")
        self.min_compute_tokens = min_compute_tokens
        self._staging: torch.Tensor | None = None
        shape = (self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim)
        if shape != kv_shape(model.config):
            raise LayoutError(
                f"layout (layers, KV heads, head dim) {shape} != the model's "
                f"{kv_shape(model.config)}"
            )
        self.store_dtype: torch.dtype = getattr(torch, self.layout.dtype)
        self.kv_dtype: torch.dtype = model.dtype
        params = inspect.signature(model.forward).parameters
        self._cache_arg = next((n for n in _CACHE_PARAM_NAMES if n in params), "past_key_values")
        self._logits_to_keep = "logits_to_keep" in params

    # -- keys ------------------------------------------------------------------------

    def keys(self, token_ids: TokenIds) -> list[BlockKey]:
        """Keys of the full blocks of ``token_ids`` under this adapter's layout."""
        return chain_keys(self.layout, _as_ids(token_ids).numpy())

    # -- store ---------------------------------------------------------------------------

    def save(self, token_ids: TokenIds, cache: Any) -> int:
        """Store the prompt's full blocks that the store does not hold yet.

        ``cache`` is the DynamicCache of a prefill of ``token_ids`` (it may
        hold more tokens, e.g. after generation: only the prompt's blocks are
        stored). The held prefix is skipped after one lookup; the rest is
        packed in one pass and stored. Returns the number of blocks stored.
        """
        keys = self.keys(token_ids)
        if not keys:
            return 0
        have = self.client.lookup(self.layout, keys).num_hits
        if have == len(keys):
            return 0
        blocks = pack_blocks(
            self.layout, cache, have * self.layout.block_tokens, len(keys) - have, self.store_dtype
        )
        held = self.client.store(self.layout, keys[have:], blocks)
        return sum(held)

    def end_turn(
        self,
        session: str,
        token_ids: TokenIds,
        *,
        wait: bool = False,
        replica_target: str = "",
        durable: bool = False,
        durable_timeout_s: float = 0.0,
    ) -> Any:
        """Tell the sidecar that ``session``'s turn ended with ``token_ids``
        (stored first with ``save``); long turns are replicated to a peer:
        ``replica_target`` (a router's spill host) or the rendezvous one.
        ``durable``: return once the remote tier's bucket holds every block
        of the turn (see ``StoreClient.end_turn``; the reply's ``durable``)."""
        ids = _as_ids(token_ids)
        return self.client.end_turn(
            session, self.layout, self.keys(ids), int(ids.numel()), wait=wait,
            replica_target=replica_target, durable=durable, durable_timeout_s=durable_timeout_s,
        )  # fmt: skip

    # -- prefill -------------------------------------------------------------------------

    def reusable_blocks(self, num_tokens: int) -> int:
        """Most blocks a resume of ``num_tokens`` tokens may take from the store."""
        return max(0, num_tokens - self.min_compute_tokens) // self.layout.block_tokens

    def resume(
        self, token_ids: TokenIds, include_peers: bool = False, *, deadline_s: float = 0.0
    ) -> ResumeResult:
        """Prefill ``token_ids``, reusing the longest stored prefix of whole
        blocks (local tiers, and peers with ``include_peers``) up to
        ``reusable_blocks``; the model runs on the remaining tokens only."""
        ids = _as_ids(token_ids)
        keys = chain_keys(
            self.layout, ids[: self.reusable_blocks(len(ids)) * self.layout.block_tokens].numpy()
        )
        t0 = time.perf_counter()
        tiers: tuple[TierName, ...] = ()
        blocks = None
        if keys:
            # load answers the longest available prefix itself (lookup + pin + copy).
            out = self._staging_rows(len(keys))
            loaded = self.client.load(
                self.layout, keys, out, include_peers=include_peers, deadline_s=deadline_s
            )
            tiers = loaded.tiers
            blocks = loaded.blocks[: loaded.num_blocks]
        t1 = time.perf_counter()
        cache = self._new_cache()
        if blocks is not None and len(tiers):
            kv = unpack_blocks(self.layout, blocks, self.kv_dtype, self._device())
            for layer, (k, v) in zip(cache.layers, kv, strict=True):
                fill_layer(layer, k, v)
        return self._forward(ids, cache, len(tiers), tiers, t1 - t0, time.perf_counter() - t1)

    def prefill(self, token_ids: TokenIds) -> ResumeResult:
        """A cold prefill (no store access), with the same logits rule as resume."""
        return self._forward(_as_ids(token_ids), self._new_cache(), 0, (), 0.0, 0.0)

    def _staging_rows(self, num_blocks: int) -> torch.Tensor:
        """One load buffer reused by every resume (it grows to the largest
        prompt's KV): faulting in a fresh one costs as much as the load."""
        size = self.layout.block_bytes
        if self._staging is None or self._staging.shape[0] < num_blocks:
            self._staging = torch.empty(
                (num_blocks, size), dtype=torch.uint8, device=self.client.device
            )
        return self._staging[:num_blocks]

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _new_cache(self) -> Any:
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=self.model.config)

    def _forward(
        self,
        ids: torch.Tensor,
        cache: Any,
        num_blocks: int,
        tiers: tuple[TierName, ...],
        store_s: float,
        restore_s: float,
    ) -> ResumeResult:
        reused = num_blocks * self.layout.block_tokens
        rest = ids[reused:].to(self._device())[None]
        # Logits of the last min_compute_tokens rows: keeps the lm_head GEMM
        # out of the small-row kernels (see the module docstring).
        keep = min(rest.shape[1], self.min_compute_tokens)
        t0 = time.perf_counter()
        kwargs = {self._cache_arg: cache}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = keep
        with torch.no_grad():
            out = self.model(input_ids=rest, use_cache=True, **kwargs)
        model_s = time.perf_counter() - t0
        return ResumeResult(
            logits=out.logits[0, -1],
            cache=out_cache(out),
            num_tokens=int(ids.numel()),
            num_reused_tokens=reused,
            tiers=tuple(tiers),
            store_s=store_s,
            restore_s=restore_s,
            model_s=model_s,
        )

    # -- generation ------------------------------------------------------------------

    def generate(
        self,
        token_ids: TokenIds,
        max_new_tokens: int,
        resume: bool = True,
        *,
        include_peers: bool = False,
        eos_token_id: int | None = None,
    ) -> GenerateResult:
        """Greedy continuation of ``token_ids``: the prompt through ``resume``
        (or a cold ``prefill``), then one token per forward pass."""
        first = self.resume(token_ids, include_peers) if resume else self.prefill(token_ids)
        cache, logits = first.cache, first.logits
        tokens: list[int] = []
        device = self._device()
        with torch.no_grad():
            while len(tokens) < max_new_tokens:
                nxt = int(torch.argmax(logits))
                tokens.append(nxt)
                if nxt == eos_token_id or len(tokens) == max_new_tokens:
                    break
                step = torch.tensor([[nxt]], device=device)
                out = self.model(input_ids=step, use_cache=True, **{self._cache_arg: cache})
                cache = out_cache(out)
                logits = out.logits[0, -1]
        return GenerateResult(tokens, first, cache)
