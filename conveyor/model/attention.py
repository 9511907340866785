"""Attention over the paged KV cache, for a flat batch of tokens from many requests.

The runner lays a step's tokens out as all single-token queries first (decodes) and then one run
per multi-token chunk (prefills, one SDPA call each: there are few per step, bounded by the token
budget). Decodes go, on the CPU in bfloat16, to one call of the paged decode kernel, which reads
the pages in place (``cpu_kernels``); elsewhere to a few SDPA calls over gathered pages, one per
group of similar context lengths so that short contexts are not padded to the longest. Where the
decode stack runs the step, short chunks' tokens are single-token queries too, each with its own
context length (its position + 1), so the kernel's causal attention needs no mask.
With FlexAttention (``flex_attention.py``, the GPU path) the whole step is one call instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from conveyor.kernels.bindings import DecodeKernel, RopeKVWrite
from conveyor.model.flex_attention import FlexPages
from conveyor.model.kv_cache import as_cached, readable, stored


@dataclass
class PrefillChunk:
    start: int            # first token of the chunk in the flat batch
    end: int              # one past its last token
    context_len: int      # tokens attended to: those already cached plus the chunk
    block_ids: torch.Tensor | None  # pages holding the context, None when the chunk is the
                                    # whole context (attend to the fresh K/V directly)

    def keys_from(self, window: int | None) -> int:
        """The first context token any of the chunk's queries attends to."""
        first_query = self.context_len - (self.end - self.start)
        return 0 if window is None else max(0, first_query - window + 1)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """[len, keys] True where a query attends to a key (from ``keys_from``): causal, and
        within the window; None where plain causal attention over the fresh K/V is that."""
        if window is None and self.block_ids is None:
            return None
        n, first = self.end - self.start, self.keys_from(window)
        q_pos = torch.arange(self.context_len - n, self.context_len, device=device).unsqueeze(1)
        k_pos = torch.arange(first, self.context_len, device=device).unsqueeze(0)
        mask = k_pos <= q_pos
        return mask if window is None else mask & (k_pos > q_pos - window)


@dataclass
class DecodeGroup:
    start: int                    # first single-token query of the group in the flat batch
                                  # (a decode, or one token of a short chunk)
    end: int
    block_tables: torch.Tensor    # [end - start, W] pages of each query's context (padded)
    context_lens: torch.Tensor    # [end - start] tokens each query attends to, its own included

    def mask(self, window: int | None, block_size: int) -> torch.Tensor:
        """[end - start, 1, 1, W * block_size] True where a slot is a key the query attends to
        (for SDPA over gathered pages; the decode kernel takes the lengths and window)."""
        slot = torch.arange(self.block_tables.shape[1] * block_size,
                            device=self.block_tables.device).unsqueeze(0)
        lens = self.context_lens.unsqueeze(1)
        live = slot < lens
        if window is not None:
            live &= slot >= lens - window
        return live[:, None, None, :]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor    # [T] where each token's K/V is written
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    decode_kernel: DecodeKernel | None = None
    rope_kv_write: RopeKVWrite | None = None
    flex: FlexPages | None = None  # every token's attention in one FlexAttention call
    # the masks each window needs, built once a step (layers share them)
    _masks: dict = field(default_factory=dict)

    def mask(self, item: PrefillChunk | DecodeGroup, window: int | None,
             block_size: int) -> torch.Tensor | None:
        key = (id(item), window)
        if key not in self._masks:
            self._masks[key] = (item.mask(window, self.slot_mapping.device)
                                if isinstance(item, PrefillChunk)
                                else item.mask(window, block_size))
        return self._masks[key]


@dataclass(frozen=True)
class Scores:
    """How a layer scores its keys: the scale (None: head_dim ** -0.5), the tokens a query
    attends to at most (None: all), Gemma 2's soft cap of the scores (None: none)."""
    scale: float | None = None
    window: int | None = None
    softcap: float | None = None


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scores: Scores = Scores()) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D], already in the caches ([num_blocks, block_size, KVH,
    D], or int8 head rows: ``kv_cache``; see ``write_kv``). Returns [T, H, D]."""
    if meta.flex is not None:
        return meta.flex.attend(q, k_cache, v_cache, scores.scale, scores.window, scores.softcap)
    block_size, kv_heads, dim = k_cache.shape[1], k_cache.shape[2], q.shape[2]
    out = torch.empty_like(q)
    groups = q.shape[1] // kv_heads
    for g in meta.decodes:
        if meta.decode_kernel is not None:
            meta.decode_kernel(q[g.start:g.end], k_cache, v_cache, g.block_tables,
                               g.context_lens, out[g.start:g.end], scale=scores.scale,
                               window=scores.window, softcap=scores.softcap)
            continue
        # Whole pages are gathered (block-sized copies), and the query heads that share a KV head
        # are laid out as that head's "query positions", so GQA needs no repeated K/V.
        n = g.end - g.start
        qd = q[g.start:g.end].view(n, kv_heads, groups, dim)
        kd = readable(gather_pages(k_cache, g.block_tables), q.dtype).transpose(1, 2)
        vd = readable(gather_pages(v_cache, g.block_tables), q.dtype).transpose(1, 2)
        o = attend(qd, kd, vd, meta.mask(g, scores.window, block_size), scores)
        out[g.start:g.end] = o.reshape(n, -1, dim)
    for chunk in meta.prefills:
        qp = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)   # [1, H, n, D]
        first = chunk.keys_from(scores.window)  # (the keys before it are outside every window)
        if chunk.block_ids is None:  # (as the cache holds them, as a later chunk reads them)
            kp = as_cached(k[chunk.start + first:chunk.end], k_cache.dtype)
            vp = as_cached(v[chunk.start + first:chunk.end], v_cache.dtype)
        else:
            kp = readable(gather_pages(k_cache, chunk.block_ids)[first:chunk.context_len],
                          q.dtype)
            vp = readable(gather_pages(v_cache, chunk.block_ids)[first:chunk.context_len],
                          q.dtype)
        kp = kp.transpose(0, 1).unsqueeze(0)
        vp = vp.transpose(0, 1).unsqueeze(0)
        o = attend(qp, kp, vp, meta.mask(chunk, scores.window, block_size), scores, gqa=True)
        out[chunk.start:chunk.end] = o.squeeze(0).transpose(0, 1)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scores: Scores, gqa: bool = False) -> torch.Tensor:
    """SDPA ([..., heads, queries, D] against [..., kv heads, keys, D]; mask None: causal);
    with a soft cap, which SDPA cannot apply, the same sums written out as transformers'
    eager attention computes them."""
    if scores.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              scale=scores.scale, enable_gqa=gqa)
    if gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scores.scale is None else scores.scale)
    s = torch.tanh(s / scores.softcap) * scores.softcap
    if mask is None:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Each token's K/V into its cache row, quantized for an int8 cache, rounded for a float16
    one (the CPU kernels fuse this with rope)."""
    kv_heads, width = k_cache.shape[2:]
    k, v = stored(k, k_cache.dtype), stored(v, v_cache.dtype)
    k_cache.view(-1, kv_heads, width).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, width).index_copy_(0, slot_mapping, v)


def gather_pages(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The cache rows of the given pages, in order: [*block_ids.shape[:-1], W * block_size, KVH,
    D] (D: the cache's row width).

    ``index_select`` on whole pages is faster on the CPU than advanced indexing
    (docs/results/design-notes#page-gather)."""
    num_blocks, block_size, kv_heads, dim = cache.shape
    rows = cache.view(num_blocks, -1).index_select(0, block_ids.flatten())
    return rows.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, kv_heads, dim)
