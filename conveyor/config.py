"""Engine settings: one dataclass, validated once here at the edge."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from conveyor.engine.kv_cache_manager import KV_LAYOUTS
from conveyor.engine.scheduler import POLICIES, SCHEDULING_POLICIES
from conveyor.kernels import isa

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}
# --quantization: GGUF block types gguf-py quantizes to (llama.cpp's reference rounding)
QUANTIZATIONS = ("q8_0", "q4_1", "q4_0")
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
    model: str | None = None
    dtype: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    policy: str = "continuous"
    kv_layout: str = "paged"    # "contiguous" reserves max_model_len per request (no sharing)
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    seed: int = 0
    device: str | None = None   # None: CUDA when present, else CPU
    threads: int | None = None  # CPU threads for the model; None: PyTorch's default
    quantization: str | None = None  # a folder's linears into these GGUF blocks at load
    tensor_parallel_size: int = 1    # ranks the layers are split across (torch.distributed)
    data_parallel_size: int = 1      # engine replicas behind one server
    distributed_init_method: str | None = None  # e.g. tcp://HOST:PORT; default: local or env://

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
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
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got "
                             f"{self.quantization!r}")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        cpu = isa.current()
        if (self.dtype == "bfloat16" and self.torch_device().type == "cpu"
                and not cpu.native_bf16):  # refused before the model loads
            raise ValueError(
                f"dtype bfloat16 needs a CPU with bfloat16 arithmetic (AVX512_BF16 or AMX, or "
                f"ARM's BF16); this one runs kernel tier {cpu.describe()}: use --dtype auto or "
                f"float32")

    def torch_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def torch_dtype(self, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
        """auto: float32 for a float32 checkpoint; else on CUDA the checkpoint's half type, and on
        a CPU bfloat16 only where it computes bfloat16 natively (the avx512 and amx tiers, ARM's
        BF16), float32 elsewhere."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
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
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * DEFAULT_CUDA_KV_SHARE)
        return int(min(available_ram() * DEFAULT_CPU_KV_SHARE, DEFAULT_CPU_KV_CAP))
