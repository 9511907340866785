"""The pool of KV pages, with a prefix cache. Pure Python: the runner owns the tensors.

A full page can carry a hash chained from its parent page's hash and its token ids; while it has
one, a request whose tokens match can take the page instead of computing it. Pages whose last
holder let go keep their hash in the free queue, evicted least recently freed first, and only
when a fresh page is needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: list[int]) -> BlockHash:
    """sha256 over the parent's hash and the page's token ids: equal hashes, equal contents."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    """Hands out page ids and takes them back; a page is free exactly when its ref count is 0."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # free pages, least recently freed first; values unused (an ordered set)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._num_cached_free = 0  # free pages whose contents a prefix hit could still reuse

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_cached_free

    @property
    def usage(self) -> float:
        """Fraction of pages held by requests, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Fresh pages, evicting the least recently freed cached ones."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV pages, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._claim(b)
            blocks.append(b)
        return blocks

    def take(self, block_ids: list[int]) -> None:
        """Hand out these particular free pages (a contiguous region), or none of them."""
        if any(self._ref_counts[b] for b in block_ids):
            raise RuntimeError(f"KV pages {block_ids[0]}..{block_ids[-1]} are not all free")
        for b in block_ids:
            del self._free[b]
            self._claim(b)

    def _claim(self, b: int) -> None:
        """A page just taken out of the free queue becomes a fresh page, held once."""
        if self._hash_of[b] is not None:
            self._num_cached_free -= 1
        self._evict(b)
        self._ref_counts[b] = 1

    def free(self, block_ids: list[int]) -> None:
        """Let go of pages; the first given is the first evicted (pass a request's tail first)."""
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"KV page {b} freed while not in use")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None
                if self._hash_of[b] is not None:
                    self._num_cached_free += 1

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # -- the prefix cache ----------------------------------------------------------------------
    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference to cached pages (a hit), out of the free queue if they were free."""
        for b in block_ids:
            if self._ref_counts[b] == 0:
                del self._free[b]
                self._num_cached_free -= 1  # only cached pages are ever touched
            self._ref_counts[b] += 1

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        """Publish a full page under its hash (the first page with a given hash wins)."""
        if not self.enable_caching or self._hash_of[block_id] is not None:
            return
        if block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self._hash_of[block_id] = block_hash

    def _evict(self, block_id: int) -> None:
        h = self._hash_of[block_id]
        if h is not None:
            del self._cached[h]
            self._hash_of[block_id] = None

    def reset_cache(self) -> bool:
        """Forget every hash; refused (False) while any page is held."""
        if self.num_used_blocks:
            return False
        self._cached.clear()
        self._hash_of = [None] * self.num_blocks
        self._num_cached_free = 0
        return True
