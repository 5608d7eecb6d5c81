"""Tokenize a conversation's next prompt without tokenizing its history again.

A chat's next turn is its last prompt plus the reply and a new message, so
its rendered text starts with the last prompt's text. Provides
``PrefixTokens.encode(text)``: the ids of ``text``, where the part up to the
last special token of a text seen before is taken from a cache and only the
rest is encoded (llm-d's gateway keeps a tokenization prefix cache for the
same reason: a long prompt takes milliseconds to tokenize, on every turn).

Why that equals encoding the whole text: a tokenizer (HF ``tokenizers``)
splits its input at added special tokens before anything else, so the ids
of ``text[:cut] + text[cut:]`` are the two parts' ids when ``text[cut:]``
starts with a special token that strips no white space next to it and is
matched before normalization (``lstrip``, ``rstrip`` and ``normalized``
off: those are the only cut points used), and when encoding adds no
special tokens of its own (``add_special_tokens`` off, as for chat
prompts, whose template writes them). ``tests/unit/gateway/
test_prefix_tokens.py`` checks it against whole encodes on a word-level and
a byte-level BPE tokenizer.

Bounded (LRU over ``max_tokens`` cached ids). Thread-safe; the encoding
itself runs outside the lock.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

import blake3
import numpy as np

MAX_CUTS_KEPT = 2  # cut points remembered per prompt (its last special tokens)


class PrefixTokens:
    """``backend``: a ``tokenizers.Tokenizer``; ``added``: its added tokens
    (``{id: AddedToken}``, as ``PreTrainedTokenizerFast.added_tokens_decoder``)."""

    def __init__(self, backend: Any, added: dict[int, Any], max_tokens: int = 1 << 24) -> None:
        self.backend = backend
        self.max_tokens = max_tokens
        cuts = [t.content for t in added.values()
                if t.special and not t.lstrip and not t.rstrip and not t.normalized]  # fmt: skip
        self._cut_re = re.compile("|".join(map(re.escape, sorted(cuts, key=len, reverse=True))))
        self._has_cuts = bool(cuts)
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cached_tokens = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _key(prefix: str) -> bytes:
        return blake3.blake3(prefix.encode()).digest(16)

    def encode(self, text: str) -> list[int]:
        """``text``'s ids (no special tokens added), reusing a cached prefix."""
        cuts = [m.start() for m in self._cut_re.finditer(text)] if self._has_cuts else []
        start, head = 0, None
        with self._lock:
            for pos in reversed(cuts):
                key = self._key(text[:pos])
                head = self._cache.get(key)
                if head is not None:
                    self._cache.move_to_end(key)
                    start = pos
                    break
            if head is None:
                self.misses += 1
            else:
                self.hits += 1
        enc = self.backend.encode(text[start:], add_special_tokens=False)
        tail = np.asarray(enc.ids, dtype=np.int64)
        ids = tail if head is None else np.concatenate([head, tail])
        self._remember(text, cuts[-MAX_CUTS_KEPT:], start, ids, len(ids) - len(tail), enc.offsets)
        return ids.tolist()  # type: ignore[no-any-return]

    def _remember(
        self, text: str, cuts: list[int], start: int, ids: np.ndarray, head_len: int,
        offsets: list[Any],
    ) -> None:  # fmt: skip
        """Cache ``text``'s ids up to each of ``cuts`` (its last special tokens);
        ``offsets``: each tail token's character span, from ``start``."""
        starts = np.fromiter((a for a, _ in offsets), dtype=np.int64, count=len(offsets))
        entries = [
            (self._key(text[:cut]), head_len + int(np.searchsorted(starts, cut - start)))
            for cut in cuts
            if cut > start
        ]
        with self._lock:
            for key, n in entries:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    continue
                self._cache[key] = ids[:n].copy()
                self._cached_tokens += n
            while self._cached_tokens > self.max_tokens and self._cache:
                _, old = self._cache.popitem(last=False)
                self._cached_tokens -= len(old)
