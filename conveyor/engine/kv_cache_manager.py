"""Maps requests to KV pages: grows each block table as its computed tokens grow."""

from __future__ import annotations

from conveyor.engine.block_pool import BlockPool
from conveyor.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_tokens_capacity(self) -> int:
        return self.pool.num_blocks * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens; False (and nothing taken) when
        the pool cannot."""
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        missing = needed - len(request.block_ids)
        if missing <= 0:
            return True
        if missing > self.pool.num_free_blocks:
            return False
        request.block_ids.extend(self.pool.allocate(missing))
        return True

    def free(self, request: Request) -> None:
        # Tail first, so a later prefix cache would evict the least shareable pages first.
        self.pool.free(request.block_ids[::-1])
        request.block_ids = []
