"""Gemma 2 and Gemma 3 (text): the Llama network with Gemma's differences, as transformers
computes them.

- The embeddings are scaled by sqrt(hidden), the scale rounded to the model dtype.
- Each layer normalises the attention's and the feed-forward's outputs too, before adding
  them to the stream (four norms a layer: ``GemmaBlock``).
- RMSNorm multiplies by (1 + w): the loader stores 1 + w (a GGUF holds it so already, as
  llama.cpp's converter writes it), so the norms are Llama's; in float32 the same sums.
- GeGLU, the scores' scale (``query_pre_attn_scalar``), Gemma 2's soft-capping of scores and
  logits, the sliding-window layers and Gemma 3's q/k norms and local rope are settings of the
  shared layers (``ModelConfig``).
"""

from __future__ import annotations

import torch

from conveyor.model.config import ModelConfig
from conveyor.model.model import RMSNorm, Transformer, TransformerBlock


class GemmaBlock(TransformerBlock):
    """``h = x + post_attention_norm(attn(norm(x))); h + post_ffn_norm(ffn(norm(h)))``: the
    shared block with its after-norms."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma(Transformer):
    block = GemmaBlock

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = super().embed(input_ids)
        return h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
