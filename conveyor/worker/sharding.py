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

A mixture of experts is split as a dense feed-forward is, every expert alike (as vLLM's default
tensor parallelism splits them, not its expert parallelism): each rank holds every expert's
gate/up rows and down columns for the same features, the router whole. Every rank routes each
token alike (the same float32 router on the same hidden state) and runs its share of the same
experts, so the ranks' work is even at any routing and the layer's one all-reduce sums the
experts' partial outputs as it sums a dense layer's. Splitting the experts across ranks instead
would leave whole layers' work on one rank when a token's few experts fall on it (Mixtral's 2
of 8 do on 2 ranks 3 times in 7). Qwen2-MoE's shared expert is split the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass

import torch

from conveyor.kernels.blocks import QuantizedWeight
from conveyor.model.config import ModelConfig

logger = logging.getLogger("conveyor")


@dataclass(frozen=True)
class Shard:
    q_heads: range
    kv_heads: range
    ffn: range    # feed-forward (intermediate) features: the dense layer's, or each expert's
    vocab: range  # the head's rows: this rank's share of the logits
    shared: range = range(0)  # the shared expert's features (Qwen2-MoE's)


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


# The down projections whose input features a shard cuts: the dense layer's or each expert's,
# and the shared expert's
_DOWN = re.compile(r"layers\.\d+\.feed_forward\.(?:experts\.\d+\.)?w2\.weight")
_SHARED_DOWN = re.compile(r"layers\.\d+\.feed_forward\.shared_expert\.w2\.weight")


def ffn_granules(config: ModelConfig, quantized: dict[str, QuantizedWeight]) -> tuple[int, int]:
    """The features the down projections can be cut at (the dense layer's or each expert's, and
    the shared expert's): their blocks' length, and the kernels' 32-value chunks where the
    features come in them."""
    def granule(features: int, down: re.Pattern) -> int:
        sizes = {q.block_values for name, q in quantized.items() if down.fullmatch(name)}
        return math.lcm(32 if features % 32 == 0 else 1, *sizes)

    moe = config.moe
    if moe is None:
        return granule(config.intermediate_size, _DOWN), 1
    return granule(moe.intermediate, _DOWN), granule(moe.shared_intermediate, _SHARED_DOWN)


def _give_out(load: list[int], features: int, granule: int, unit_load: int) -> list[range]:
    """Each rank's features: units of ``granule`` each to the rank with the least ``load``
    so far (which each adds ``unit_load`` to); what is left over to the last rank."""
    units = [0] * len(load)
    for _ in range(features // granule):
        r = min(range(len(load)), key=lambda i: load[i])
        units[r] += 1
        load[r] += unit_load
    cuts = [0]
    for u in units:
        cuts.append(cuts[-1] + u * granule)
    cuts[-1] = features
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def plan_shards(config: ModelConfig, ranks: int, granule: int = 1,
                shared_granule: int = 1) -> list[Shard]:
    """Each rank's heads and features. Where heads divide unevenly (SmolLM2-135M's 3 KV heads
    over 2 ranks), the feed-forward features are given out to even the ranks' work a token:
    units of ``granule`` features each to the rank holding the fewest matrix elements a token
    reads so far. A shared expert's (in units of ``shared_granule``) are shared out evenly.
    Every rank must get some of each expert's features."""
    if config.qk_norm_whole:
        raise ValueError(f"tensor parallelism is not implemented for {config.architecture}'s "
                         f"q/k norms over all heads at once; run it with "
                         f"--tensor-parallel-size 1")
    attention = _attention_shards(config, ranks)
    d, hidden, moe = config.head_dim, config.hidden_size, config.moe
    load = [2 * hidden * d * (len(q) + len(kv)) for q, kv in attention]  # q, o; k, v
    if moe is None:
        ffn = _give_out(load, config.intermediate_size, granule, 3 * hidden * granule)
        shared = [range(0)] * ranks
    else:  # (each token runs ``used`` experts; the shared expert's units evenly by count)
        ffn = _give_out(load, moe.intermediate, granule, 3 * hidden * granule * moe.used)
        shared = _give_out([0] * ranks, moe.shared_intermediate, shared_granule, 1)
        if not all(ffn) or moe.shared_intermediate and not all(shared):
            raise ValueError(f"each expert's {moe.intermediate} features (shared: "
                             f"{moe.shared_intermediate}), cut in pieces of {granule} "
                             f"({shared_granule}), cannot be divided among {ranks} "
                             f"tensor-parallel ranks")
    vocab = [config.vocab_size * r // ranks for r in range(ranks + 1)]
    return [Shard(q, kv, f, range(v, w), s) for (q, kv), f, s, v, w
            in zip(attention, ffn, shared, vocab, vocab[1:])]


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

    attention = {"wq": (0, features(shard.q_heads)), "wk": (0, features(shard.kv_heads)),
                 "wv": (0, features(shard.kv_heads)), "wo": (1, features(shard.q_heads))}
    feed_forward = {"w1": 0, "w3": 0, "w2": 1}  # (gate, up, down: of the layer or an expert)

    def cut(parts: list[str]) -> tuple[int, range] | None:
        """The dimension and range a layer's tensor is cut along (None: replicated)."""
        if parts[0] != "layers":
            return None
        if parts[2] == "attention":
            return attention.get(parts[3])
        if parts[2] == "feed_forward" and parts[-2] in feed_forward:
            return feed_forward[parts[-2]], (shard.shared if parts[3] == "shared_expert"
                                             else shard.ffn)
        return None

    local_weights, local_quantized, dense = {}, {}, []
    for name in weights.keys() | quantized.keys():
        parts = name.split(".")
        cut_here = cut(parts)
        if cut_here is None:  # replicated
            if name in weights:
                local_weights[name] = weights[name]
            if name in quantized:
                local_quantized[name] = quantized[name]
            continue
        dim, part = cut_here
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
    moe = config.moe and dataclasses.replace(config.moe, intermediate=len(shard.ffn),
                                             shared_intermediate=len(shard.shared))
    local = dataclasses.replace(config, num_heads=len(shard.q_heads),
                                num_kv_heads=len(shard.kv_heads), tie_word_embeddings=False,
                                moe=moe, intermediate_size=(len(shard.ffn) if moe is None
                                                            else config.intermediate_size))
    return local, local_weights, local_quantized
