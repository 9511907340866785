"""Rotary position embeddings: each position's cos and sin tables, with the rope scalings
Hugging Face configs name (linear, llama3, YaRN, LongRoPE) and GGUF files store (llama3's as
per-pair frequency factors), and their application to q and k (all of each head, or its first
dimensions: partial rotary)."""

from __future__ import annotations

import dataclasses
import math

import torch

from conveyor.model.config import ModelConfig


def rope_inv_freq(config: ModelConfig, long: bool = False) -> torch.Tensor:
    """Each rotated pair's frequency (the rotary dimensions': ``config.rotary``); long:
    LongRoPE's long factors instead of its short ones (``longrope_switch``)."""
    dim = config.rotary
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(config)
    if scaling["rope_type"] == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        return inv_freq / torch.tensor(factors, dtype=torch.float32)
    if scaling["rope_type"] == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(config: ModelConfig) -> torch.Tensor:
    """YaRN: each dimension's frequency interpolated (divided by ``factor``) where it turns
    fewer than ``beta_slow`` times over the pretrained length, kept where it turns more than
    ``beta_fast`` times, a linear ramp between (as transformers computes it)."""
    s, dim, base = config.rope_scaling, config.rotary, config.rope_theta
    old_len = s["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dimension that turns this often over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return (1.0 / (s["factor"] * pos_freqs) * (1 - extrapolated)
            + 1.0 / pos_freqs * extrapolated)


def longrope_switch(config: ModelConfig, max_len: int) -> int | None:
    """The pretrained length past which LongRoPE's long factors rotate a token, where a served
    sequence (up to ``max_len``) may pass it; else None (the short factors only).

    transformers' rule, which Conveyor follows token by token: a forward pass rotates with the
    long factors when its sequence (a prompt at once, or a prompt and the tokens sampled so
    far) is longer than the pretrained length; the keys cached before keep their rotation. So a
    prompt token of a longer prompt takes the long ones, a sampled token once its position
    passes that length. (llama.cpp picks once by the served length instead.)"""
    s = config.rope_scaling
    if s is None or s["rope_type"] != "longrope":
        return None
    pretrained = s["original_max_position_embeddings"]
    return pretrained if max_len > pretrained else None


def rope_attention_factor(config: ModelConfig) -> float:
    """What YaRN and LongRoPE scale cos and sin by (so q.k by its square):
    ``attention_factor``, else YaRN's from ``factor`` and ``mscale``/``mscale_all_dim``,
    LongRoPE's from the ratio of the model's length to the pretrained one; 1 for every other
    rope."""
    s = config.rope_scaling
    if s is None or s["rope_type"] not in ("yarn", "longrope"):
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    if s["rope_type"] == "longrope":
        old_len = s["original_max_position_embeddings"]
        factor = s.get("factor") or config.max_position_embeddings / old_len
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.get("mscale") and s.get("mscale_all_dim"):
        return float(mscale(s["factor"], s["mscale"]) / mscale(s["factor"], s["mscale_all_dim"]))
    return mscale(s["factor"])


def rope_tables(config: ModelConfig, max_len: int, dtype: torch.dtype,
                device: torch.device, long: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin of every position, [max_len, rotary dims], in the model dtype: the
    sin's first half is negated so that rotating a vector is one ``roll`` (see ``apply_rope``)."""
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), rope_inv_freq(config, long))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    factor = rope_attention_factor(config)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    sin[:, :freqs.shape[1]].neg_()
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)


def model_rope_tables(config: ModelConfig, max_len: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rope a layer may read (``ModelConfig.rope_index``): the model's (where LongRoPE
    switches, its short rows then its long ones: a token reads row ``position`` or ``max_len +
    position``); the sliding layers' own base where they have one (Gemma 3's, unscaled); and
    where some layer has no rope (SmolLM3's), cos 1 and sin 0, which leave q and k as they
    are."""
    tables = [rope_tables(config, max_len, dtype, device)]
    if longrope_switch(config, max_len) is not None:
        long = rope_tables(config, max_len, dtype, device, long=True)
        tables[0] = tuple(torch.cat(pair) for pair in zip(tables[0], long))
    if config.local_rope_theta is not None:
        local = dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None)
        tables.append(rope_tables(local, max_len, dtype, device))
    if config.no_rope_layers:
        cos = tables[0][0]
        tables.append((torch.ones_like(cos), torch.zeros_like(cos)))
    return tables


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/sin: [T, 1, R] (the half-rotation layout transformers uses, whose
    ``cat(-x2, x1) * sin`` equals ``roll(x) * signed sin`` bit for bit). R < D: partial
    rotary, the first R dimensions rotated and the rest passed through."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    return x * cos + torch.roll(x, rotary // 2, -1) * sin
