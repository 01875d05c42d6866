"""KV of finished sequences, kept for the next request that extends them (the next turn of an
episode): that request prefills only what was appended since.

Entries are keyed by their exact token ids; a hit leaves the entry in place (the n episodes of a
group often answer alike and then share it) and makes it the most recently used. The least
recently used go first once the stored tokens pass the budget, which in a multi-turn workload are
the earlier turns of episodes that moved on.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CachedPrefix:
    kv: torch.Tensor
    """Keys and values of every layer, token-major (one slice per token, so that a row's first
    tokens are one slice): [tokens, layers, 2 (keys, values), kv_heads, head_dim]."""
    version: int
    """Oldest policy version whose weights computed any of these keys."""

    @property
    def length(self) -> int:
        return self.kv.shape[0]


class PrefixCache:
    """At most `max_tokens` tokens of KV, least recently used evicted first."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[bytes, CachedPrefix] = OrderedDict()
        self._lengths: Counter[int] = Counter()  # entry length -> entries of that length
        self.tokens = 0
        """Tokens stored now."""

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, token_ids: Sequence[int], prefix: CachedPrefix) -> None:
        """Store the KV of `token_ids` (one position per token)."""
        if prefix.length != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens but KV for {prefix.length}")
        if prefix.length > self.max_tokens:
            return
        key = _key(token_ids)
        self._discard(key)
        self._entries[key] = prefix
        self._lengths[prefix.length] += 1
        self.tokens += prefix.length
        while self.tokens > self.max_tokens:
            self._discard(next(iter(self._entries)))

    def match(self, token_ids: Sequence[int], min_version: int) -> CachedPrefix | None:
        """The longest stored proper prefix of `token_ids` (at least one token is left to feed)
        whose version is at least `min_version`."""
        key = _key(token_ids)
        for length in sorted(self._lengths, reverse=True):
            if length >= len(token_ids):
                continue
            prefix = self._entries.get(key[: 4 * length])
            if prefix is not None and prefix.version >= min_version:
                self._entries.move_to_end(key[: 4 * length])
                return prefix
        return None

    def drop_older(self, version: int) -> None:
        """Drop every entry whose version is below `version`."""
        for key in [k for k, p in self._entries.items() if p.version < version]:
            self._discard(key)

    def _discard(self, key: bytes) -> None:
        prefix = self._entries.pop(key, None)
        if prefix is None:
            return
        self._lengths[prefix.length] -= 1
        if not self._lengths[prefix.length]:
            del self._lengths[prefix.length]
        self.tokens -= prefix.length


def _key(token_ids: Sequence[int]) -> bytes:
    # Fixed-width bytes, so that a prefix of n tokens is the key's first 4n bytes.
    return np.asarray(token_ids, dtype=np.int32).tobytes()
