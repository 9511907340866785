"""Attention over the paged KV cache, for a flat batch of tokens from many requests.

The runner lays a step's tokens out as all single-token queries first (decodes) and then one run
per multi-token chunk (prefills, one SDPA call each: there are few per step, bounded by the token
budget). Decodes go, on the CPU in bfloat16, to one call of the paged decode kernel, which reads
the pages in place (``cpu_kernels``); elsewhere to a few SDPA calls over gathered pages, one per
group of similar context lengths so that short contexts are not padded to the longest. Where the
decode stack runs the step, short chunks' tokens are single-token queries too, each with its own
context length (its position + 1), so the kernel's causal attention needs no mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from conveyor.kernels.bindings import DecodeKernel, RopeKVWrite


@dataclass
class PrefillChunk:
    start: int            # first token of the chunk in the flat batch
    end: int              # one past its last token
    context_len: int      # tokens attended to: those already cached plus the chunk
    block_ids: torch.Tensor | None  # pages holding the context, None when the chunk is the
                                    # whole context (attend to the fresh K/V directly)
    mask: torch.Tensor | None       # [len, context_len] causal mask with offset, or None


@dataclass
class DecodeGroup:
    start: int                    # first single-token query of the group in the flat batch
                                  # (a decode, or one token of a short chunk)
    end: int
    block_tables: torch.Tensor    # [end - start, W] pages of each query's context (padded)
    context_lens: torch.Tensor    # [end - start] tokens each query attends to, its own included
    mask: torch.Tensor | None     # [end - start, 1, 1, W * block_size] True where a slot is
                                  # real; None when the decode kernel runs the group


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor    # [T] where each token's K/V is written
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    decode_kernel: DecodeKernel | None = None
    rope_kv_write: RopeKVWrite | None = None


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D], already in the caches ([num_blocks, block_size, KVH,
    D]; see ``write_kv``). Returns [T, H, D]."""
    num_blocks, block_size, kv_heads, dim = k_cache.shape
    out = torch.empty_like(q)
    groups = q.shape[1] // kv_heads
    for g in meta.decodes:
        if meta.decode_kernel is not None:
            meta.decode_kernel(q[g.start:g.end], k_cache, v_cache, g.block_tables,
                               g.context_lens, out[g.start:g.end])
            continue
        # Whole pages are gathered (block-sized copies), and the query heads that share a KV head
        # are laid out as that head's "query positions", so GQA needs no repeated K/V.
        n = g.end - g.start
        qd = q[g.start:g.end].view(n, kv_heads, groups, dim)
        kd = gather_pages(k_cache, g.block_tables).transpose(1, 2)  # [n, KVH, L, D]
        vd = gather_pages(v_cache, g.block_tables).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask)
        out[g.start:g.end] = o.reshape(n, -1, dim)
    for chunk in meta.prefills:
        qp = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)   # [1, H, n, D]
        if chunk.block_ids is None:
            kp, vp = k[chunk.start:chunk.end], v[chunk.start:chunk.end]
        else:
            kp = gather_pages(k_cache, chunk.block_ids)[:chunk.context_len]
            vp = gather_pages(v_cache, chunk.block_ids)[:chunk.context_len]
        kp = kp.transpose(0, 1).unsqueeze(0)
        vp = vp.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=chunk.mask,
                                           is_causal=chunk.mask is None, enable_gqa=True)
        out[chunk.start:chunk.end] = o.squeeze(0).transpose(0, 1)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Each token's K/V into its cache row (the CPU bfloat16 path fuses this with rope)."""
    kv_heads, dim = k_cache.shape[2:]
    k_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, dim).index_copy_(0, slot_mapping, v)


def gather_pages(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The cache rows of the given pages, in order: [*block_ids.shape[:-1], W * block_size, KVH, D].

    ``index_select`` on whole pages is faster on the CPU than advanced indexing
    (docs/results/design-notes#page-gather)."""
    num_blocks, block_size, kv_heads, dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, block_ids.flatten())
    return rows.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, kv_heads, dim)
