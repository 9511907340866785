"""Mixture-of-experts networks (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): the Llama network whose
feed-forward is a router and a set of experts, as transformers computes it.

- The router is float32 whatever the model dtype (as llama.cpp computes it): softmax over the
  experts, each token's ``used`` most probable kept, their weights renormalised to sum to 1
  where the family does (``MoE.norm_topk``).
- Each expert is the shared ``FeedForward`` (SwiGLU), so its matrices are read as the dense
  model's are: from their GGUF blocks by the CPU kernels, views of the file's map.
- A step's (token, expert) pairs are grouped by expert, so that every chosen expert runs once
  over all its rows, the experts in ascending order, each one's weighted output added to its
  tokens' sums: the order transformers adds them in. On the CPU kernels the router and the
  experts are one call (``kernel``), the experts side by side across threads.
- Qwen2-MoE's shared expert runs on every token, its output scaled by sigmoid(x . w).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels.experts import MoEKernel
from conveyor.model.config import ModelConfig
from conveyor.model.model import FeedForward, Linear, Transformer, TransformerBlock


class Route:
    """A step's routing: which experts each token runs, with what weight, grouped by expert."""

    def __init__(self, weights: torch.Tensor, chosen: torch.Tensor, experts: int) -> None:
        """weights, chosen: [T, used] (float32, int64)."""
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # the (token, slot) pairs, expert by expert
        self.tokens = order // chosen.shape[1]
        self.weights = weights.flatten()[order]
        self.counts = torch.bincount(flat, minlength=experts).tolist()

    def groups(self):
        """(expert, its tokens [n], their weights [n]) for each expert that has tokens, in
        ascending order."""
        start = 0
        for expert, n in enumerate(self.counts):
            if n:
                yield expert, self.tokens[start:start + n], self.weights[start:start + n]
            start += n


class SparseMoE(nn.Module):
    # the CPU kernel of the router and the experts, one call a step (csrc/moe_ffn.c), when
    # attached; steps it does not take (kernel.takes) run the loop below
    kernel: MoEKernel | None = None

    def __init__(self, config: ModelConfig, stats: torch.Tensor | None = None) -> None:
        """stats: the network's MoE totals (MoETransformer.moe_stats), which this adds to
        (its own where not given)."""
        super().__init__()
        self.stats = torch.zeros(2, dtype=torch.int64, device="cpu") if stats is None else stats
        moe = config.moe
        self.used, self.norm_topk = moe.used, moe.norm_topk
        # [experts, hidden], float32 (placed by apply_backend)
        self.router = nn.Parameter(torch.empty(moe.experts, config.hidden_size),
                                   requires_grad=False)
        self.experts = nn.ModuleList(FeedForward(config, moe.intermediate)
                                     for _ in range(moe.experts))
        shared = moe.shared_intermediate
        self.shared_expert = FeedForward(config, shared) if shared else None
        self.shared_gate = Linear(config.hidden_size, 1, bias=False) if shared else None

    def route(self, x: torch.Tensor) -> Route:
        probs = torch.softmax(F.linear(x.float(), self.router), dim=-1)
        weights, chosen = probs.topk(self.used, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Route(weights, chosen, len(self.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter_ns()
        if self.kernel is not None and self.kernel.takes(x.shape[0]):
            out = self.kernel(x)  # (which adds its own time and experts to the stats)
            start = time.perf_counter_ns()
        else:
            out = torch.zeros_like(x)
            route = self.route(x)
            for expert, tokens, weights in route.groups():
                y = self.experts[expert](x[tokens])
                out.index_add_(0, tokens, (y * weights[:, None]).to(out.dtype))
            self.stats[1] += sum(n > 0 for n in route.counts)
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_gate(x)) * self.shared_expert(x)
        self.stats[0] += time.perf_counter_ns() - start
        return out


class MoEBlock(TransformerBlock):
    """The shared block with the experts for its feed-forward."""

    def __init__(self, config: ModelConfig, layer: int, stats: torch.Tensor) -> None:
        super().__init__(config, layer)
        self.feed_forward = SparseMoE(config, stats)


class MoETransformer(Transformer):
    def __init__(self, config: ModelConfig, head_rows: int | None = None) -> None:
        # What the MoE layers have done so far, all of them: nanoseconds, and the distinct
        # experts each layer ran, summed (a step's share of them: the engine's StepRecord).
        # On the CPU whatever device the network is built on.
        self.moe_stats = torch.zeros(2, dtype=torch.int64, device="cpu")
        super().__init__(config, head_rows)

    def block(self, config: ModelConfig, layer: int) -> MoEBlock:
        return MoEBlock(config, layer, self.moe_stats)
