"""What the KV cache stores: the model dtype, float16 for a float32 model (``--kv-cache-dtype
float16``, the default where the CPU kernels read it), or int8 (``--kv-cache-dtype int8``).

An int8 cache keeps each token's head as a row of ``head_dim`` int8 values followed by the
four bytes of its float32 scale (value = scale * int, scale = max |x| / 127): one tensor per
cache as before, ``[blocks, block_size, kv_heads, head_dim + 4]``, so pages, prefix reuse and
tensor-parallel shards need nothing new. The CPU kernels read the rows as they lie
(``kernels/csrc/common.h``); the PyTorch path quantizes here when it writes and widens the pages
it gathers. A float16 cache is llama.cpp's default: half a float32 model's bytes, widened
exactly when read.
"""

from __future__ import annotations

import torch

from conveyor.config import KV_CACHE_DTYPES, EngineConfig
from conveyor.kernels.library import reads_half_caches

SCALE_BYTES = 4  # a head row's float32 scale, after its values


def kv_storage(kv_cache_dtype: str, dtype: torch.dtype, half_default: bool = False
               ) -> torch.dtype:
    """The caches' torch dtype for ``--kv-cache-dtype``: ``auto``, the model dtype, or float16
    for a float32 model where ``half_default`` (the kernels read halves); the model dtype by its
    own name; float16 for a float32 model; int8. Any other 16- or 32-bit cache is refused: the
    kernels read the model dtype or halves of float32."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
    if kv_cache_dtype == "auto":
        return torch.float16 if half_default and dtype == torch.float32 else dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype == "float16" and dtype == torch.float32:
        return torch.float16
    if getattr(torch, kv_cache_dtype) != dtype:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype} needs a {kv_cache_dtype} model "
                         f"(--dtype {kv_cache_dtype})"
                         f"{' or a float32 one' if kv_cache_dtype == 'float16' else ''}; this "
                         f"one runs in {str(dtype).removeprefix('torch.')}: use auto or int8")
    return dtype


def cache_storage(config: EngineConfig, dtype: torch.dtype, device: torch.device,
                  head_dim: int) -> torch.dtype:
    """What an engine of ``config`` stores: ``auto`` takes halves of a float32 model where the
    CPU kernels read the cache (not FlexAttention)."""
    half = (reads_half_caches(device, dtype, head_dim)
            and config.attention(device) == "TORCH_SDPA")
    return kv_storage(config.kv_cache_dtype, dtype, half)


def head_width(head_dim: int, storage: torch.dtype) -> int:
    """Elements of one token's head in a cache of ``storage``."""
    return head_dim + SCALE_BYTES if storage == torch.int8 else head_dim


def head_bytes(head_dim: int, storage: torch.dtype) -> int:
    return head_width(head_dim, storage) * torch.tensor([], dtype=storage).element_size()


def quantize(x: torch.Tensor) -> torch.Tensor:
    """[..., D] of the model dtype as int8 head rows [..., D + 4] (as the kernels write them:
    common.h's kv_quantize)."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) * torch.tensor(1 / 127, dtype=torch.float32)
    q = torch.where(scale > 0, torch.round(x / scale), 0.0).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 head rows [..., D + 4] as values [..., D] of ``dtype``."""
    dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., dim:].contiguous().view(torch.float32)
    return (rows[..., :dim].float() * scale).to(dtype)


def readable(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as values of the model dtype (int8 and float16 ones widened; others as they
    are)."""
    return dequantize(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)


def stored(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """Values of the model dtype as a cache of ``storage`` holds them (int8 head rows, or
    float16)."""
    return quantize(x) if storage == torch.int8 else x.to(storage)


def as_cached(x: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """Values of the model dtype as read back from a cache of ``storage``: a prompt's own keys
    then equal those a later step (or a prefix hit) reads, so its chunking does not change them."""
    return x if storage == x.dtype else readable(stored(x, storage), x.dtype)
