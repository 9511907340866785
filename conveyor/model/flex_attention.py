"""Attention over the paged KV cache in one FlexAttention call a layer (the GPU path): every
token of a step, decodes and prefill chunks alike, is a query of one flat sequence, and the keys
are the whole cache, read in place as one sequence of slots. A mask over (query, slot) says
which slots a query attends to, through each query's block table: no gathered copy of the pages
and no mask tensor of the step's size.

The mask is FlexAttention's two parts, as vLLM's FlexAttention backend builds them:
- ``mask_mod``, evaluated per (query, slot) inside the kernel: the slot's page's place in the
  query's block table (``page_index``, -1 where the page is not the query's), hence the slot's
  position, which must not pass the query's (causal) nor fall out of its window;
- a ``BlockMask``: for each block of ``Q_BLOCK`` queries, the pages any of them reads, so the
  kernel visits only those.

Everything is built on the device from fixed-shape inputs with no host sync, so a decode step,
metadata included, can be captured in a CUDA graph (``worker/decode_graphs.py``). On the CPU,
FlexAttention runs unfused (each score materialised): that is for tests, against the CPU path.
"""

from __future__ import annotations

from functools import cache

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# Queries a sparse block holds (the key blocks are pages). Decodes of different requests share a
# block, and it lists the pages of all of them; 16 keeps those lists short.
Q_BLOCK = 16


@cache
def _compiled():
    """FlexAttention compiled to fused kernels (Triton on CUDA), once per process (a new step
    length recompiles it once, then as dynamic shapes: torch.compile's default)."""
    return torch.compile(flex_attention, fullgraph=True)


class FlexPages:
    """A step's queries and the pages they read, as FlexAttention's mask.

    positions: [T] each query's position in its sequence (it attends to positions <= it);
    sequences: [T] each query's row of ``tables``;
    tables: [S, W] each sequence's block table, -1 past its last page;
    num_pages: pages in the caches (the slots are ``num_pages * block_size``)."""

    def __init__(self, positions: torch.Tensor, sequences: torch.Tensor, tables: torch.Tensor,
                 block_size: int, num_pages: int) -> None:
        self.positions, self.sequences = positions, sequences
        self.block_size, self.num_pages = block_size, num_pages
        rows, width = tables.shape
        # page_index[s, p]: where page p is in sequence s's table, or -1; the column past the
        # last page takes the tables' padding (never read: no slot lies on it)
        logical = torch.arange(width, dtype=torch.int32, device=tables.device).expand(rows, -1)
        self.page_index = torch.full((rows, num_pages + 1), -1, dtype=torch.int32,
                                     device=tables.device).scatter_(
            1, torch.where(tables < 0, num_pages, tables).long(), logical.contiguous())
        self._masks: dict[int | None, BlockMask] = {}

    def _kv_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For each block of Q_BLOCK queries: how many pages its queries read, and those pages
        first (in page order), then the others: ``BlockMask.from_kv_blocks``'s layout."""
        T = self.positions.shape[0]
        q_blocks = -(-T // Q_BLOCK)
        block_of = torch.arange(T, device=self.positions.device) // Q_BLOCK
        member = torch.zeros(q_blocks, self.page_index.shape[0], device=self.positions.device)
        member[block_of, self.sequences.long()] = 1.0
        reads = (self.page_index[:, :self.num_pages] >= 0).float()
        present = (member @ reads) > 0
        counts = present.sum(dim=-1, dtype=torch.int32)
        order = torch.argsort((~present).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts[None, None], order[None, None]

    def block_mask(self, window: int | None) -> BlockMask:
        """The mask for a layer with this window (None: none), made once a step."""
        if window not in self._masks:
            page_index, sequences, positions = self.page_index, self.sequences, self.positions
            bs = self.block_size

            def mask_mod(b, h, q, kv):
                logical = page_index[sequences[q], kv // bs]
                kv_pos = logical * bs + kv % bs
                allowed = (logical >= 0) & (kv_pos <= positions[q])
                if window is not None:
                    allowed = allowed & (positions[q] - kv_pos < window)
                return allowed

            counts, order = self._kv_blocks()
            self._masks[window] = BlockMask.from_kv_blocks(
                counts, order, BLOCK_SIZE=(Q_BLOCK, bs), mask_mod=mask_mod,
                seq_lengths=(self.positions.shape[0], self.num_pages * bs),
                compute_q_blocks=False)
        return self._masks[window]

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float | None, window: int | None, softcap: float | None) -> torch.Tensor:
        """q: [T, H, D]; the caches [pages, block_size, KVH, D] with this step's K/V written.
        Returns [T, H, D]."""
        T, heads, dim = q.shape
        kv_heads = k_cache.shape[2]
        keys = k_cache.view(1, -1, kv_heads, dim).transpose(1, 2)   # [1, KVH, slots, D]
        values = v_cache.view(1, -1, kv_heads, dim).transpose(1, 2)
        on_gpu = q.is_cuda
        run = _compiled() if on_gpu else flex_attention
        out = run(q.transpose(0, 1).unsqueeze(0), keys, values, score_mod=_soft_cap(softcap),
                  block_mask=self.block_mask(window), scale=scale, enable_gqa=heads != kv_heads,
                  # the kernel's tiles are the sparse blocks (a page of keys), and the main
                  # kernel takes short steps too: vLLM's choices for a mask built from block
                  # tables
                  kernel_options={"BLOCK_M": Q_BLOCK, "BLOCK_N": self.block_size,
                                  "FORCE_USE_FLEX_ATTENTION": True} if on_gpu else None)
        return out.squeeze(0).transpose(0, 1)


def _soft_cap(cap: float | None):
    """Gemma 2's soft cap of the scores as a FlexAttention score_mod (None: none)."""
    if cap is None:
        return None

    def score_mod(score, b, h, q, kv):
        return torch.tanh(score / cap) * cap
    return score_mod
