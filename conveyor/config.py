"""Engine settings: one dataclass, validated once here at the edge."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from conveyor.core.kv_cache_manager import KV_LAYOUTS
from conveyor.core.scheduler import POLICIES, SCHEDULING_POLICIES, SchedulerConfig
from conveyor.kernels import isa
from conveyor.sampling_params import POOLING_TYPES
from conveyor.settings import check_choices, setting

if TYPE_CHECKING:
    import torch

# torch is imported where a dtype or device is made, so that the CLI's --help needs none
_DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16",
           "float16": "float16", "half": "float16"}
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}
# --quantization: GGUF block types gguf-py quantizes to (llama.cpp's reference rounding)
QUANTIZATIONS = ("q8_0", "q4_1", "q4_0")
TASKS = ("generate", "embed")
ACTIVATION_QUANTS = ("auto", "none", "int16", "int8")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "int8")  # (model/kv_cache.py)
# vLLM's names: FlexAttention over the pages in place (model/flex_attention.py); the CPU's paged
# decode kernel and SDPA over gathered pages (model/attention.py)
ATTENTION_BACKENDS = ("auto", "FLEX_ATTENTION", "TORCH_SDPA")
DEFAULT_CPU_KV_SHARE = 0.25        # of available RAM ...
DEFAULT_CPU_KV_CAP = 4 * 2**30     # ... but no more than vLLM's CPU default of 4 GiB
DEFAULT_CUDA_KV_SHARE = 0.8        # of free device memory after the weights


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string such as "2GiB", "512MB", "1e9"."""
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"kv_cache_memory {value!r} is not a size like '2GiB' or '512MB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value!r}")
    return n


def available_ram() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class EngineConfig:
    """The engine's settings, spelled as vLLM spells them: the ``conveyor generate`` and
    ``conveyor serve`` flags and ``LLM``'s keywords are these fields (``conveyor.settings``)."""

    model: str | None = setting(
        None, "a .gguf file, a Hugging Face folder, or a Hub repo id (org/name, from the local "
              "Hub cache or downloaded; org/name:FILE.gguf picks one GGUF) (default: "
              "SmolLM2-135M-Instruct)")
    revision: str | None = setting(None, "a repo id's branch, tag or commit (vLLM's)")
    tokenizer: str | None = setting(
        None, "the tokenizer (and chat template) of another .gguf, folder or repo id, in place "
              "of the model's (vLLM's; default: the model's own)")
    task: str = setting(
        "generate", "generate: text (completions, chat); embed: a vector per input "
                    "(/v1/embeddings, LLM.embed): the last hidden states pooled, as vLLM's "
                    "--runner pooling", choices=TASKS)
    pooling_type: str | None = setting(
        None, "embed: how a prompt's hidden states become one vector (default: the model's, "
              "from a sentence-transformers folder or a GGUF; else last)",
        choices=POOLING_TYPES)
    generation_config: str = setting(
        "auto", "sampling defaults for requests that leave them unset: auto, the model's own "
                "(a folder's generation_config.json, a GGUF's general.sampling.*); vllm, none "
                "(the API's defaults); or a folder holding generation_config.json (vLLM's)",
        metavar="auto|vllm|FOLDER")
    chat_template: str | None = setting(
        None, "a Jinja chat template in place of the model's: a file holding it, or the "
              "template itself (vLLM's flag)", metavar="FILE_OR_TEMPLATE")
    dtype: str = setting("auto", "the model's dtype", choices=("auto", *_DTYPES))
    block_size: int = setting(16, "tokens per KV page")
    num_kv_blocks: int | None = setting(None, "KV pages in the pool")
    kv_cache_memory: int | str | None = setting(
        None, "KV pool size in memory, e.g. 2GiB (default: a share of free memory)")
    max_num_seqs: int = setting(64, "most requests in one batch")
    max_num_batched_tokens: int = setting(2048, "token budget of one step")
    max_model_len: int | None = setting(
        None, "longest prompt + output (default: the model's, capped by the pool)")
    policy: str = setting("continuous", "batching policy", choices=POLICIES)
    kv_layout: str = setting(
        "paged", "contiguous: reserve max_model_len per request at admission, as static serving "
                 "stacks do (to measure what paging saves; no prefix caching)",
        choices=KV_LAYOUTS)
    kv_cache_dtype: str = setting(
        "auto", "what the KV cache stores: auto, the model dtype, or float16 for a float32 model "
                "where the CPU kernels run (AVX2 and up: half the bytes, llama.cpp's default); "
                "float16 (a float32 model); int8, a byte a value and a scale per token and head "
                "(about half of bfloat16's memory and reads)",
        choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = setting(True, "reuse the KV pages of shared prompt prefixes")
    scheduling_policy: str = setting(
        "fcfs", "priority: lower `priority` values are admitted first and preempted last",
        choices=SCHEDULING_POLICIES)
    seed: int = setting(0, "the sampler's seed for requests without their own")
    device: str | None = setting(None, "cpu or cuda (default: cuda when present)")
    threads: int | None = setting(None, "CPU threads for the model (default: PyTorch's)")
    adaptive_threads: bool = setting(
        True, "run on fewer threads while other processes keep cores busy, at most --threads "
              "(Linux; docs/results/shared-cpu)")
    attention_backend: str = setting(
        "auto", "how attention reads the paged KV cache: FLEX_ATTENTION, one FlexAttention call "
                "a layer for the whole step through the block tables (compiled to Triton on "
                "CUDA); TORCH_SDPA, the CPU's paged decode kernel and SDPA for prompts; auto: "
                "FLEX_ATTENTION on CUDA, TORCH_SDPA elsewhere (vLLM's flag)",
        choices=ATTENTION_BACKENDS)
    enforce_eager: bool = setting(
        False, "run decode steps eagerly; otherwise on CUDA with FLEX_ATTENTION they replay "
               "CUDA graphs captured at a ladder of batch sizes (vLLM's flag)")
    activation_quant: str = setting(
        "auto", "the GGUF block linears multiply integer activations: each run of 32 inputs "
                "scaled to int16 (15 bits), or int8 with llama.cpp's numerics (Q8_0; Q8_K, a "
                "scale per 256, on the K-quants); a decode's few rows at the avx512/amx tiers "
                "(VNNI), at the avx2 tier int8 every K-quant call (repacked at load); auto: "
                "int8 on the K-quants where it is faster than float (the avx2 and avx512 "
                "tiers), float elsewhere; none: float; agreement and speed: "
                "docs/results/activation-quant",
        choices=ACTIVATION_QUANTS)
    batch_invariant: bool = setting(
        False, "each request's tokens and logprobs the same whatever else is in its batch, "
               "however its prompt was chunked and whether its prefix came from the cache "
               "(for evals and reruns; CPU kernels only; cost: docs/results/batch-invariance)")
    quantization: str | None = setting(
        None, "quantize a Hugging Face folder's linears into these GGUF blocks at load",
        choices=QUANTIZATIONS)
    tensor_parallel_size: int = setting(
        1, "split the layers across this many ranks (torch.distributed: local processes, or "
           "torchrun's ranks)", short="-tp")
    data_parallel_size: int = setting(
        1, "serve with this many engine replicas (conveyor serve)", short="-dp")
    distributed_init_method: str | None = setting(
        None, "where the ranks meet (default: a local port, or env:// under torchrun)",
        metavar="tcp://HOST:PORT")

    def __post_init__(self) -> None:
        check_choices(self)
        if self.kv_layout == "contiguous":
            self.enable_prefix_caching = False  # a region belongs to one request
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size", "data_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("num_kv_blocks", "max_model_len", "threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.scheduler_config(self.max_model_len or 1)  # the scheduler's own rules, checked now
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        if self.batch_invariant and self.activation_quant not in ("auto", "none"):
            raise ValueError("batch_invariant takes float activations: --activation-quant "
                             "quantizes a step's rows by how many there are")
        cpu = isa.current()
        if (self.dtype == "bfloat16" and self.torch_device().type == "cpu"
                and not cpu.native_bf16):  # refused before the model loads
            raise ValueError(
                f"dtype bfloat16 needs a CPU with bfloat16 arithmetic (AVX512_BF16 or AMX, or "
                f"ARM's BF16); this one runs kernel tier {cpu.describe()}: use --dtype auto or "
                f"float32")

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's settings (its config checks them) at this model length."""
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_model_len,
                               self.policy, self.scheduling_policy)

    def attention(self, device: torch.device) -> str:
        """The attention backend ``attention_backend`` names on this device (auto: FlexAttention
        on CUDA, unless the cache is int8, which it does not read)."""
        if self.attention_backend != "auto":
            return self.attention_backend
        return ("FLEX_ATTENTION" if device.type == "cuda" and self.kv_cache_dtype != "int8"
                else "TORCH_SDPA")

    def decode_graphs(self, device: torch.device) -> bool:
        """Whether decode steps replay CUDA graphs (FlexAttention's metadata is built on the
        device, so a whole step can be captured; the CPU path's is not). Not yet with tensor
        parallel ranks: a capture holding their collectives has not run (docs/gpu.md)."""
        return (not self.enforce_eager and device.type == "cuda"
                and self.attention(device) == "FLEX_ATTENTION"
                and self.tensor_parallel_size == 1)

    def torch_device(self) -> torch.device:
        import torch

        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def torch_dtype(self, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
        """auto: float32 for a float32 checkpoint; else on CUDA the checkpoint's half type, and on
        a CPU bfloat16 only where it computes bfloat16 natively (the avx512 and amx tiers, ARM's
        BF16), float32 elsewhere."""
        import torch

        if self.dtype != "auto":
            return getattr(torch, _DTYPES[self.dtype])
        if checkpoint_dtype == "float32":
            return torch.float32
        if device.type == "cuda":
            return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16
        return torch.bfloat16 if isa.current().native_bf16 else torch.float32

    def dtype_reason(self, checkpoint_dtype: str | None, device: torch.device) -> str:
        """Why ``torch_dtype`` chose what it did, for the start-up log and /version."""
        if self.dtype != "auto":
            return "as asked"
        if checkpoint_dtype == "float32":
            return "auto: the checkpoint is float32"
        if device.type == "cuda":
            return "auto: CUDA"
        return ("auto: the CPU computes bfloat16 natively" if isa.current().native_bf16
                else "auto: the CPU has no bfloat16 arithmetic")

    def kv_cache_bytes(self, device: torch.device) -> int:
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        if device.type == "cuda":
            import torch

            free, _ = torch.cuda.mem_get_info(device)
            return int(free * DEFAULT_CUDA_KV_SHARE)
        return int(min(available_ram() * DEFAULT_CPU_KV_SHARE, DEFAULT_CPU_KV_CAP))
