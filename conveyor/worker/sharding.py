"""Megatron-style tensor-parallel shards of a loaded model: which heads and feed-forward features
each rank holds, and its slices of the weights.

q/k/v and gate/up are column-parallel (each rank computes its heads' and features' outputs),
the attention output and down projection row-parallel (each rank's partial sum, then one
all-reduce each). KV heads are divided among ranks whole, with their query heads; with fewer KV
heads than ranks each is replicated on ``ranks // kv_heads`` ranks that split its query heads.
Embedding and norms are replicated; the head is vocabulary-parallel (each rank computes its
rows' logits, gathered on rank 0, which samples). GGUF matrices are cut
along whole blocks, so the block kernels run unchanged on each shard; a cut through a block
leaves that matrix dense on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch

from conveyor.kernels.blocks import QuantizedWeight
from conveyor.model.config import ModelConfig

logger = logging.getLogger("conveyor")


@dataclass(frozen=True)
class Shard:
    q_heads: range
    kv_heads: range
    ffn: range    # feed-forward (intermediate) features
    vocab: range  # the head's rows: this rank's share of the logits


def _attention_shards(config: ModelConfig, ranks: int) -> list[tuple[range, range]]:
    heads, kv_heads = config.num_heads, config.num_kv_heads
    group = heads // kv_heads  # query heads per KV head
    if kv_heads >= ranks:  # whole KV heads with their query heads, as even as counts allow
        cuts = [kv_heads * r // ranks for r in range(ranks + 1)]
        return [(range(a * group, b * group), range(a, b)) for a, b in zip(cuts, cuts[1:])]
    share = ranks // kv_heads  # ranks per replicated KV head
    if ranks % kv_heads or group % share:
        raise ValueError(f"{heads} query heads over {kv_heads} KV heads cannot be divided "
                         f"among {ranks} tensor-parallel ranks")
    per = group // share
    return [(range(r // share * group + r % share * per, r // share * group + (r % share + 1)
                   * per), range(r // share, r // share + 1)) for r in range(ranks)]


def ffn_granule(config: ModelConfig, quantized: dict[str, QuantizedWeight]) -> int:
    """The feed-forward features a down projection can be cut at: its blocks' length, and the
    kernels' 32-value chunks where the features come in them."""
    sizes = [quantized[n].block_values for i in range(config.num_layers)
             if (n := f"layers.{i}.feed_forward.w2.weight") in quantized]
    return math.lcm(32 if config.intermediate_size % 32 == 0 else 1, *sizes)


def plan_shards(config: ModelConfig, ranks: int, granule: int = 1) -> list[Shard]:
    """Each rank's heads and features. Where heads divide unevenly (SmolLM2-135M's 3 KV heads
    over 2 ranks), the feed-forward features are given out to even the ranks' weights: units of
    ``granule`` features each to the rank holding the fewest matrix elements so far."""
    if config.moe is not None:
        raise ValueError(f"tensor parallelism is not implemented for mixture-of-experts models "
                         f"({config.architecture}); run them with --tensor-parallel-size 1")
    attention = _attention_shards(config, ranks)
    d, hidden = config.head_dim, config.hidden_size
    load = [2 * hidden * d * (len(q) + len(kv)) for q, kv in attention]  # q, o; k, v
    units = [0] * ranks
    for _ in range(config.intermediate_size // granule):
        r = min(range(ranks), key=lambda i: load[i])
        units[r] += 1
        load[r] += 3 * hidden * granule  # gate, up, down
    cuts = [0]
    for u in units:
        cuts.append(cuts[-1] + u * granule)
    cuts[-1] = config.intermediate_size
    vocab = [config.vocab_size * r // ranks for r in range(ranks + 1)]
    return [Shard(q, kv, range(a, b), range(v, w)) for (q, kv), a, b, v, w
            in zip(attention, cuts, cuts[1:], vocab, vocab[1:])]


def kv_heads_per_rank(config: ModelConfig, ranks: int) -> list[int]:
    return [len(kv) for _, kv in _attention_shards(config, ranks)]


def _slice_blocks(q: QuantizedWeight, dim: int, part: range) -> QuantizedWeight | None:
    """Rows (dim 0) or input columns (dim 1) of a matrix in blocks; None across a block."""
    if dim == 0:
        return QuantizedWeight(q.ggml_type, q.blocks[part.start:part.stop].contiguous(), q.wide)
    if part.start % q.block_values or part.stop % q.block_values:
        return None
    a, b = (i // q.block_values * q.block_bytes for i in (part.start, part.stop))
    return QuantizedWeight(q.ggml_type, q.blocks[:, a:b].contiguous(), q.wide)


def shard_model(config: ModelConfig, weights: dict[str, torch.Tensor],
                quantized: dict[str, QuantizedWeight], shard: Shard
                ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """This rank's config (its heads and features) and slices of the loader-named weights."""
    d = config.head_dim

    def features(heads: range) -> range:
        return range(heads.start * d, heads.stop * d)

    cuts = {"attention.wq": (0, features(shard.q_heads)),
            "attention.wk": (0, features(shard.kv_heads)),
            "attention.wv": (0, features(shard.kv_heads)),
            "attention.wo": (1, features(shard.q_heads)),
            "feed_forward.w1": (0, shard.ffn), "feed_forward.w3": (0, shard.ffn),
            "feed_forward.w2": (1, shard.ffn)}
    local_weights, local_quantized, dense = {}, {}, []
    for name in weights.keys() | quantized.keys():
        parts = name.split(".")
        cut = cuts.get(".".join(parts[2:4])) if parts[0] == "layers" else None
        if cut is None:  # replicated
            if name in weights:
                local_weights[name] = weights[name]
            if name in quantized:
                local_quantized[name] = quantized[name]
            continue
        dim, part = cut
        if parts[-1] == "bias" and dim == 1:  # a row-parallel bias is added once, on rank 0
            raise ValueError(f"{name}: a bias on a row-parallel linear is not supported")
        q = quantized.get(name)
        if q is not None and (piece := _slice_blocks(q, dim, part)) is not None:
            local_quantized[name] = piece
        elif q is not None:
            dense.append(name)
        if name in weights or q is None or name in dense:
            whole = weights[name] if name in weights else q.dequantize()
            local_weights[name] = whole.narrow(dim, part.start, len(part)).contiguous()
    if dense:
        logger.info("tensor parallel: %d matrices are cut through their blocks and run dense: "
                    "%s", len(dense), ", ".join(sorted(dense)[:4]) + (" ..." if len(dense) > 4
                                                                      else ""))
    # The head, vocabulary-parallel: this rank's rows as an untied output matrix (a tied
    # embedding stays whole, for the lookup).
    head = "tok_embeddings.weight" if config.tie_word_embeddings else "output.weight"
    if head in weights:
        local_weights["output.weight"] = weights[head][shard.vocab.start:shard.vocab.stop].clone()
    if head in quantized:
        local_quantized["output.weight"] = _slice_blocks(quantized[head], 0, shard.vocab)
    local = dataclasses.replace(config, num_heads=len(shard.q_heads),
                                num_kv_heads=len(shard.kv_heads), intermediate_size=len(shard.ffn),
                                tie_word_embeddings=False)
    return local, local_weights, local_quantized
