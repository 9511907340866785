"""Maps requests to KV pages: finds cached prefixes, grows block tables, publishes full pages.

``KV_LAYOUTS``: ``paged`` grows a request page by page as its tokens arrive; ``contiguous`` is what
static serving stacks do, kept to measure what paging saves: each request reserves one region of
``max_model_len`` tokens, contiguous in the cache, when it is admitted, used or not.
"""

from __future__ import annotations

import heapq

from conveyor.core.block_pool import BlockHash, BlockPool, hash_block
from conveyor.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.prefix_queries = 0   # tokens looked up in the prefix cache
        self.prefix_hits = 0      # of which found

    @property
    def num_tokens_capacity(self) -> int:
        return self.pool.num_blocks * self.block_size

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the request's first ``num_blocks`` full pages (memoised: a
        page's tokens never change)."""
        hashes, bs = request.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else request.cache_salt,
                                     request.all_token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_blocks]

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The longest run of cached pages matching the request's tokens; at least its last
        token is left to compute, so the step that computes it yields logits."""
        if not self.pool.enable_caching:
            return []
        blocks = []
        for h in self._hashes(request, (request.num_tokens - 1) // self.block_size):
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(blocks) * self.block_size
        return blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[int] = ()) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens after the ``cached_blocks`` (a
        prefix hit, for a request holding no pages); False, with nothing taken, when the pool
        cannot."""
        have = len(request.block_ids) + len(cached_blocks)
        computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        missing = max(0, cdiv(computed + num_new_tokens, self.block_size) - have)
        revived = sum(1 for b in cached_blocks if self.pool.ref_count(b) == 0)
        if missing + revived > self.pool.num_free_blocks:
            return False
        self.pool.touch(cached_blocks)
        request.block_ids.extend(cached_blocks)
        request.num_published_blocks = max(request.num_published_blocks, len(cached_blocks))
        request.block_ids.extend(self.pool.allocate(missing))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the pages that the computed tokens have filled."""
        if not self.pool.enable_caching:
            return
        full = request.num_computed_tokens // self.block_size
        hashes = self._hashes(request, full)
        for i in range(request.num_published_blocks, full):
            self.pool.cache(request.block_ids[i], hashes[i])
        request.num_published_blocks = full

    def free(self, request: Request) -> None:
        # Tail first, so the least shareable pages are evicted first.
        self.pool.free(request.block_ids[::-1])
        request.block_ids = []
        request.num_published_blocks = 0


class ContiguousKVCacheManager(KVCacheManager):
    """One region of ``cdiv(max_model_len, block_size)`` consecutive pages per request, taken
    whole at admission and given back whole. No prefix sharing: a region belongs to one request."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        super().__init__(num_blocks, block_size, enable_caching=False)
        self.region_blocks = cdiv(max_model_len, block_size)
        self.num_regions = num_blocks // self.region_blocks
        if self.num_regions < 1:
            raise ValueError(f"a contiguous region of max_model_len {max_model_len} tokens needs "
                             f"{self.region_blocks} KV pages; the pool has {num_blocks}")
        self._free_regions = list(range(self.num_regions))  # a heap

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[int] = ()) -> bool:
        if request.block_ids:  # its region already covers max_model_len
            return True
        if not self._free_regions:
            return False
        start = heapq.heappop(self._free_regions) * self.region_blocks
        request.block_ids = list(range(start, start + self.region_blocks))
        self.pool.take(request.block_ids)
        return True

    def free(self, request: Request) -> None:
        if request.block_ids:
            heapq.heappush(self._free_regions, request.block_ids[0] // self.region_blocks)
        super().free(request)


KV_LAYOUTS = ("paged", "contiguous")


def make_kv_cache_manager(layout: str, num_blocks: int, block_size: int, max_model_len: int,
                          enable_caching: bool) -> KVCacheManager:
    if layout == "contiguous":
        return ContiguousKVCacheManager(num_blocks, block_size, max_model_len)
    return KVCacheManager(num_blocks, block_size, enable_caching)
