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
        cuts = {i: t.content for i, t in added.items()
                if t.special and not t.lstrip and not t.rstrip and not t.normalized}  # fmt: skip
        self._cut_ids = np.array(sorted(cuts), dtype=np.int64)
        self._cut_re = re.compile(
            "|".join(map(re.escape, sorted(cuts.values(), key=len, reverse=True)))
        )
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cached_tokens = 0
        self.hits = 0
        self.misses = 0
        self.unmatched = 0

    @staticmethod
    def _keys(text: str, cuts: list[int]) -> list[bytes]:
        """The key of ``text[:cut]`` for each of ``cuts`` (ascending), in one
        pass over the text (blake3 of its UTF-8, which is per character)."""
        hasher = blake3.blake3()
        keys, prev = [], 0
        for cut in cuts:
            hasher.update(text[prev:cut].encode())
            prev = cut
            keys.append(hasher.copy().digest(16))
        return keys

    def encode(self, text: str, max_tail_chars: int | None = None) -> list[int] | None:
        """``text``'s ids (no special tokens added), reusing a cached prefix;
        None (nothing encoded) when more than ``max_tail_chars`` would be left
        to encode: the caller then encodes on a worker thread."""
        cuts = [m.start() for m in self._cut_re.finditer(text)] if self._cut_ids.size else []
        keys = self._keys(text, cuts)
        start, hit, head = 0, -1, None
        with self._lock:
            for i in range(len(cuts) - 1, -1, -1):
                head = self._cache.get(keys[i])
                if head is not None:
                    self._cache.move_to_end(keys[i])
                    start, hit = cuts[i], i
                    break
            if max_tail_chars is not None and len(text) - start > max_tail_chars:
                return None
            if head is None:
                self.misses += 1
            else:
                self.hits += 1
        tail = np.asarray(self.backend.encode(text[start:], add_special_tokens=False).ids,
                          dtype=np.int64)  # fmt: skip
        ids = tail if head is None else np.concatenate([head, tail])
        # The cut tokens of the tail are the cuts from the hit on, in order (each
        # is extracted whole, as one id); the first is the hit's own.
        at = (np.flatnonzero(np.isin(tail, self._cut_ids)) + (len(ids) - len(tail))).tolist()
        at = at[1 if hit >= 0 else 0 :]
        if len(at) == len(keys) - hit - 1:
            self._remember(ids, list(zip(keys[hit + 1 :], at))[-MAX_CUTS_KEPT:])
        else:  # the text's cut tokens were not all extracted as such: cache nothing
            self.unmatched += 1
        return ids.tolist()  # type: ignore[no-any-return]

    def _remember(self, ids: np.ndarray, entries: list[tuple[bytes, int]]) -> None:
        """Cache ``ids[:n]`` under each (key, n) of ``entries``."""
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
