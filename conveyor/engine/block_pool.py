"""The pool of KV pages. Pure Python: the runner owns the tensors, this owns who holds which page."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """Hands out page ids and takes them back; a page is free exactly when its ref count is 0."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of pages in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.num_used_blocks / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV pages, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"KV page {b} freed while not in use")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]
