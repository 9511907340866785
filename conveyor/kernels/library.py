"""The CPU kernels for a dtype at this process's tier: built on first use, or None with one log
line saying why (no compiler, a build error, a dtype or shape no kernel takes), and the model
then runs plain PyTorch. Nothing here may take the process down for the machine it is on."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from dataclasses import dataclass

import torch

from conveyor.kernels import build, isa
from conveyor.kernels.bindings import (GLU_KERNELS, AddRMSNorm, ArgmaxRows, DecodeKernel,
                                       DecodeStack, DequantRows, GatedMul, IntQuantLinear,
                                       QuantLinear, RopeKVWrite, SampleRows, StackLayer)
from conveyor.kernels.experts import MoEKernel
from conveyor.kernels.signatures import bind, has_entry

logger = logging.getLogger("conveyor")

BF16_HEAD_DIMS = (64, 128, 256)  # the specialisations paged_decode_bf16.c compiles
# --activation-quant auto: int8 on the K-quants at the tiers where that is faster than float
# (docs/results/activation-quant): avx2 (their repacked kernel, at every row count) and avx512
# (VNNI, a decode's few rows); float at amx (its bfloat16 tiles) and generic, and on the other
# block types (a float operation a chunk for their scale a chunk: slower than float)
AUTO_INT8_TIERS = ("avx2", "avx512")
OFF = "CONVEYOR_CPU_KERNELS"


@dataclass
class CPUKernels:
    tier: str
    dtype: torch.dtype
    decode_attention: DecodeKernel
    add_rms_norm: AddRMSNorm
    gated_mul: dict[str, GatedMul]  # by activation (GLU_KERNELS)
    rope_kv_write: RopeKVWrite
    quant_linear: QuantLinear
    argmax_rows: ArgmaxRows
    sample_rows: SampleRows
    dequant_rows: DequantRows
    lib: ctypes.CDLL

    def _linear_routing(self) -> dict:
        """How quant_linear routes a call, for the C code that calls the block linears."""
        linear = self.quant_linear
        integer = ({"levels": linear.levels, "int_rows": linear.int_rows,
                    "superblock_rows": linear.superblock_rows}
                   if isinstance(linear, IntQuantLinear) else {})
        return {"max_rows": linear.max_rows, "invariant": linear.invariant, **integer}

    def decode_stack(self, layers: list[StackLayer], **shape) -> DecodeStack:
        """The one-call layer stack over these layers (its linears as quant_linear's)."""
        return DecodeStack(self.lib, self.dtype, layers, **self._linear_routing(), **shape)

    def moe(self, router: torch.Tensor, w13: list, w2: list, **shape) -> MoEKernel:
        """One layer's experts in one call (their linears as quant_linear's)."""
        return MoEKernel(self.lib, self.dtype, router, w13, w2, **self._linear_routing(),
                         **shape)


@functools.cache
def load_library(tier: str) -> ctypes.CDLL | None:
    """The tier's library, built once per process (and cached on disk); None, logged, if it
    cannot be built or loaded."""
    cc = build.compiler()
    if cc is None:
        logger.warning("no C compiler found: the CPU kernels are off, the model runs plain "
                       "PyTorch (slower)")
        return None
    try:
        return ctypes.CDLL(str(build.build(tier, isa.current(), cc)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", "") or str(e)).strip()
        logger.warning("could not build the %s CPU kernels, running plain PyTorch: %s", tier,
                       detail.splitlines()[-1] if detail else e)
        return None


def unavailable(dtype: torch.dtype, head_dim: int, tier: str) -> str | None:
    """Why no kernel takes this dtype and head_dim at this tier, or None if they do."""
    if os.environ.get(OFF, "").lower() == "off":
        return f"{OFF}=off"
    if dtype == torch.bfloat16:
        if tier not in isa.BF16_TIERS:
            return f"bfloat16 kernels need the avx512 or amx tier (this is {tier})"
        if head_dim not in BF16_HEAD_DIMS:
            return f"the bfloat16 decode attention takes head_dim {BF16_HEAD_DIMS}, not {head_dim}"
        return None
    if dtype != torch.float32:
        return f"no CPU kernels for {dtype}"
    if tier != "generic" and (head_dim % 8 or head_dim > 256):
        return ("the vectorised float32 decode attention takes head_dim a multiple of 8 up to 256, "
                f"not {head_dim}")
    return None


def reads_half_caches(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this process's kernels read a float16 KV cache of a float32 model (F16C: the
    tiers above generic), which ``--kv-cache-dtype auto`` then picks
    (docs/results/kv-cache-dtype)."""
    tier = isa.current().tier
    return (device.type == "cpu" and dtype == torch.float32 and tier != "generic"
            and unavailable(dtype, head_dim, tier) is None)


def kernels_at(tier: str, dtype: torch.dtype, head_dim: int, activation_quant: str = "none",
               batch_invariant: bool = False) -> CPUKernels | None:
    """The kernels of ``tier`` (which this CPU must be able to run) for this dtype; the block
    linears on integer activations unless ``activation_quant`` is "none" (or "auto" where
    float is the faster), each row's result independent of the other rows' where
    ``batch_invariant`` (float activations)."""
    if unavailable(dtype, head_dim, tier) is not None:
        return None
    lib = load_library(tier)
    if lib is None or not has_entry(lib, "quant_linear", dtype):
        return None
    if activation_quant == "auto" and (tier not in AUTO_INT8_TIERS or batch_invariant):
        activation_quant = "none"
    linear = (IntQuantLinear(lib, dtype, activation_quant, tier) if activation_quant != "none"
              else QuantLinear(lib, dtype, batch_invariant))
    return CPUKernels(tier, dtype, DecodeKernel(lib, dtype), AddRMSNorm(lib, dtype),
                      {act: GatedMul(lib, dtype, act) for act in GLU_KERNELS},
                      RopeKVWrite(lib, dtype), linear, ArgmaxRows(lib), SampleRows(lib),
                      DequantRows(lib, dtype), lib)


def cpu_kernels(device: torch.device, dtype: torch.dtype, head_dim: int,
                activation_quant: str = "none", batch_invariant: bool = False
                ) -> CPUKernels | None:
    """The kernels for this process's tier when they apply here (the CPU, float32 at any tier,
    bfloat16 where the tier computes it) and build."""
    if device.type != "cpu":
        return None
    tier = isa.current().tier
    why = unavailable(dtype, head_dim, tier)
    if why is not None:
        logger.info("CPU kernels off: %s; the model runs plain PyTorch", why)
        return None
    return kernels_at(tier, dtype, head_dim, activation_quant, batch_invariant)


def describe(device: torch.device, dtype: torch.dtype, head_dim: int,
             kernels: CPUKernels | None) -> str:
    """One line: which path the model runs here, and why."""
    if device.type != "cpu":
        return f"PyTorch on {device.type}"
    choice = isa.current()
    if kernels is not None:
        linear = kernels.quant_linear
        integer = isinstance(linear, IntQuantLinear)
        return (f"C kernels{f', {linear.numerics()}' if integer else ''}"
                f"{', batch invariant' if linear.invariant else ''}, "
                f"CPU tier {choice.describe()}")
    why = (unavailable(dtype, head_dim, choice.tier)
           or "the kernels did not build (see the warning above)")
    return f"plain PyTorch ({why}), CPU tier {choice.describe()}"


def fma_peak(threads: int) -> float | None:
    """This machine's float32 multiply-add peak at its tier's vector width, in GFLOP/s, measured
    (``csrc/fma_peak.c``); None without the kernels."""
    lib = load_library(isa.current().tier)
    if lib is None:
        return None
    return bind(lib, "fma_peak_gflops")(threads, 0.25, 5)
