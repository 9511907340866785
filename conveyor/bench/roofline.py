"""A step's time on an accelerator we do not have: its roofline, from published peak figures.

    seconds = max(FLOPs / (peak x compute efficiency), bytes / (bandwidth x bandwidth efficiency))
              + step overhead + request overhead x requests in the step

FLOPs: 2 x the layers' linear weights x tokens, 2 x the head x requests (one logits row each),
4 x layers x query heads x head size x query-key pairs. Bytes: every weight once, the KV positions
the attention reads and the ones the step writes. The defaults: 60% of peak FLOP/s (prompt
GEMMs reach 60-70%), 80% of the memory bandwidth (what a decode step's streaming reads reach),
1 ms a step (scheduling, input copies and sampling around a CUDA-graph replay) and 10 us a
request in it (its sampling, detokenization and stream). All flags: measure yours and set them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cached_property

from conveyor.bench.cost_model import StepShape
from conveyor.model.config import ModelConfig

GIB = 2**30
ACTIVATION_RESERVE = 1 * GIB  # left out of the KV budget for activations and CUDA graphs


@dataclass(frozen=True)
class Accelerator:
    name: str
    bf16_flops: float       # dense peak FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: int       # as nvidia-smi reports the total


# Datasheet figures: dense bf16 tensor-core peak (no sparsity), HBM/GDDR bandwidth.
ACCELERATORS = {a.name.lower(): a for a in (
    Accelerator("H100-SXM", 989e12, 3.35e12, 81559 * 2**20),
    Accelerator("H100-PCIe", 756e12, 2.0e12, 81559 * 2**20),
    Accelerator("H200", 989e12, 4.8e12, 143771 * 2**20),
    Accelerator("A100-80GB", 312e12, 2.039e12, 81920 * 2**20),
    Accelerator("A100-40GB", 312e12, 1.555e12, 40960 * 2**20),
    Accelerator("L40S", 362e12, 864e9, 46068 * 2**20),
    Accelerator("L4", 121e12, 300e9, 23034 * 2**20),
)}
ALIASES = {"h100": "h100-sxm", "a100": "a100-80gb"}


def accelerator(name: str) -> Accelerator:
    key = name.lower().replace("_", "-").replace(" ", "-")
    key = ALIASES.get(key, key)
    if key not in ACCELERATORS:
        raise ValueError(f"--accelerator {name!r} is not known; known: "
                         f"{', '.join(a.name for a in ACCELERATORS.values())} (or H100, A100)")
    return ACCELERATORS[key]


def _llama(vocab, hidden, ffn, layers, heads, kv_heads, max_len, tied) -> ModelConfig:
    return ModelConfig("llama", vocab, hidden, ffn, layers, heads, kv_heads, hidden // heads,
                       1e-5, 500000.0, None, max_len, tied, False, False, "bfloat16")


# Configs of models whose weights need not be here: their config.json's shapes.
MODEL_CONFIGS = {
    "llama-3-8b": _llama(128256, 4096, 14336, 32, 32, 8, 8192, False),
    "llama-3-70b": _llama(128256, 8192, 28672, 80, 64, 8, 8192, False),
    "smollm2-135m": _llama(49152, 576, 1536, 30, 9, 3, 8192, True),
}


def model_config(name_or_path: str | None) -> ModelConfig:
    """A named config, or the config of a GGUF file or Hugging Face folder (default model: None)."""
    if name_or_path is not None and name_or_path.lower() in MODEL_CONFIGS:
        return MODEL_CONFIGS[name_or_path.lower()]
    if name_or_path is not None and not os.path.exists(name_or_path):
        raise ValueError(f"--model-config {name_or_path!r} is neither a model file or folder nor "
                         f"one of {', '.join(MODEL_CONFIGS)}")
    from conveyor.model.loader import load_config

    return load_config(name_or_path)


def layer_weights(c: ModelConfig) -> int:
    """Parameters of one layer's linears (from the loader's table of the model's tensors)."""
    from conveyor.model.loader import expected_shapes

    return sum(math.prod(shape) for name, shape in expected_shapes(c).items()
               if name.startswith("layers.0.") and len(shape) == 2)


@dataclass(frozen=True)
class RooflineCost:
    device: Accelerator
    model: ModelConfig
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    step_overhead: float = 1e-3     # seconds
    request_overhead: float = 10e-6  # seconds, per request in the step
    weight_bits: int = 16

    def __post_init__(self) -> None:
        for name in ("compute_efficiency", "bandwidth_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in (0, 1]")
        if self.step_overhead < 0 or self.request_overhead < 0:
            raise ValueError("overheads must be >= 0")
        if self.weight_bits not in (4, 8, 16, 32):
            raise ValueError("--weight-bits must be 4, 8, 16 or 32")

    @cached_property
    def _linear_weights(self) -> int:
        """Parameters of all layers' linears (what every token multiplies)."""
        return self.model.num_layers * layer_weights(self.model)

    @property
    def weight_bytes(self) -> int:
        """All weights held (an untied embedding besides the head)."""
        c = self.model
        matrices = self._linear_weights + c.vocab_size * c.hidden_size * (
            1 if c.tie_word_embeddings else 2)
        return matrices * self.weight_bits // 8

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """bfloat16 K and V of every layer."""
        import torch

        from conveyor.worker.runner import kv_bytes_per_block

        return kv_bytes_per_block(self.model, 1, torch.bfloat16)

    def kv_cache_bytes(self, gpu_memory_utilization: float = 0.9) -> int:
        """What is left for the KV cache once the weights are in (vLLM's budget: a share of the
        memory), refused when nothing is."""
        free = (int(self.device.memory_bytes * gpu_memory_utilization) - self.weight_bytes
                - ACTIVATION_RESERVE)
        if free <= 0:
            raise ValueError(
                f"the weights ({self.weight_bytes / GIB:.1f} GiB at {self.weight_bits} bits) leave "
                f"no KV memory in {gpu_memory_utilization:.0%} of a {self.device.name}'s "
                f"{self.device.memory_bytes / GIB:.0f} GiB: try --weight-bits 8 or a larger "
                f"accelerator")
        return free

    def step_seconds(self, shape: StepShape) -> float:
        c = self.model
        head = c.vocab_size * c.hidden_size
        flops = (2 * self._linear_weights * shape.num_tokens
                 + 2 * head * shape.num_seqs
                 + 4 * c.num_layers * c.num_heads * c.head_dim * shape.num_attention_pairs)
        read = ((self._linear_weights + head) * self.weight_bits // 8
                + self.kv_bytes_per_token * (shape.num_context_tokens + shape.num_tokens))
        return (max(flops / (self.device.bf16_flops * self.compute_efficiency),
                    read / (self.device.memory_bandwidth * self.bandwidth_efficiency))
                + self.step_overhead + self.request_overhead * shape.num_seqs)

    def describe(self) -> str:
        return (f"{self.device.name} roofline ({self.device.bf16_flops / 1e12:.0f} TFLOP/s x "
                f"{self.compute_efficiency:g}, {self.device.memory_bandwidth / 1e12:.2f} TB/s x "
                f"{self.bandwidth_efficiency:g}, {self.step_overhead * 1e3:g} ms a step + "
                f"{self.request_overhead * 1e6:g} us a request)")
