"""Which kernel tier this CPU runs, read from its feature flags once at start.

Tiers, lowest first. Each builds the same kernel sources (``csrc/``) for its instruction set, as
llama.cpp builds its CPU backend once per x86-64 level and loads the best one the machine has:

- ``generic``: plain C the compiler vectorises for its default target, float32 compute; any CPU.
- ``avx2``: x86-64 with AVX2, FMA and F16C; float32 compute (no bfloat16 arithmetic).
- ``avx512``: AVX-512 F/BW/VL/DQ, AVX512_BF16 and VNNI; bfloat16 compute (products on bfloat16
  pairs), int8 products for the integer activations.
- ``amx``: the above and AMX tiles (AMX-TILE, AMX-BF16, AMX-INT8) for the products.

``CONVEYOR_CPU_ISA=generic|avx2|avx512|amx`` forces a lower tier, and the whole process then
behaves as on such a CPU: the dtype ``auto`` picks, oneDNN's bfloat16 prepacking and every
kernel choice (``conveyor/__init__.py`` also caps ATen's and oneDNN's own dispatch).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

TIERS = ("generic", "avx2", "avx512", "amx")
ENV = "CONVEYOR_CPU_ISA"

# The flags (as /proc/cpuinfo spells them) each tier needs on top of the one below it.
REQUIRED_FLAGS = {
    "generic": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"),
    "amx": ("amx_tile", "amx_bf16", "amx_int8"),
}
# What the tiers at and above avx512 compute in: they have bfloat16 arithmetic.
BF16_TIERS = ("avx512", "amx")
# ATen's and oneDNN's names for the same ceilings (set before torch first dispatches).
ATEN_CAPABILITY = {"generic": "default", "avx2": "avx2", "avx512": "avx512", "amx": "avx512"}
ONEDNN_MAX_ISA = {"generic": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE_BF16",
                  "amx": "AVX512_CORE_AMX"}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first CPU's feature flags (x86 ``flags``, ARM ``Features``); empty if unreadable."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def is_x86(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("x86_64", "amd64", "i686", "i386")


def best_tier(flags: frozenset[str], x86: bool = True) -> str:
    """The highest tier whose flags, and those of every tier below it, are all present."""
    best = "generic"
    if not x86:
        return best
    for tier in TIERS[1:]:
        if not all(f in flags for f in REQUIRED_FLAGS[tier]):
            break
        best = tier
    return best


@dataclass(frozen=True)
class IsaChoice:
    tier: str             # the tier the kernels and the dtype follow
    detected: str         # the best tier this CPU has
    forced: bool          # CONVEYOR_CPU_ISA chose a lower tier
    flags: frozenset[str]
    x86: bool

    @property
    def native_bf16(self) -> bool:
        """Whether the CPU computes bfloat16 natively at this tier (AVX512_BF16, AMX; on ARM,
        the BF16 extension), which is what makes bfloat16 the faster dtype."""
        if self.x86:
            return self.tier in BF16_TIERS
        return "bf16" in self.flags and not self.forced

    def missing(self, tier: str) -> list[str]:
        """The flags this CPU lacks for ``tier`` and the tiers below it."""
        i = TIERS.index(tier)
        return [f for t in TIERS[1:i + 1] for f in REQUIRED_FLAGS[t] if f not in self.flags]

    def describe(self) -> str:
        """One line: the tier and the flags that decided it."""
        if self.forced:
            why = f"forced by {ENV}={self.tier} on a CPU whose best is {self.detected}"
        elif not self.x86:
            why = f"{platform.machine()}: no x86 tiers"
        else:
            have = [f for t in TIERS[1:TIERS.index(self.tier) + 1] for f in REQUIRED_FLAGS[t]]
            nxt = TIERS.index(self.tier) + 1
            lacks = ([f for f in REQUIRED_FLAGS[TIERS[nxt]] if f not in self.flags]
                     if nxt < len(TIERS) else [])
            why = ", ".join(filter(None, [f"has {' '.join(have)}" if have else "",
                                          f"lacks {' '.join(lacks)}" if lacks else ""]))
        return f"{self.tier} ({why})"


def choose(flags: frozenset[str] | None = None, requested: str | None = None,
           machine: str | None = None) -> IsaChoice:
    """The tier for these flags (default: this CPU's) and this request (default: $CONVEYOR_CPU_ISA).
    A request above what the CPU has is refused: it would die of an illegal instruction."""
    flags = cpu_flags() if flags is None else flags
    x86 = is_x86(machine)
    detected = best_tier(flags, x86)
    requested = os.environ.get(ENV) if requested is None else requested
    if not requested:
        return IsaChoice(detected, detected, False, flags, x86)
    requested = requested.strip().lower()
    if requested not in TIERS:
        raise ValueError(f"{ENV}={requested!r}: expected one of {', '.join(TIERS)}")
    if TIERS.index(requested) > TIERS.index(detected):
        probe = IsaChoice(detected, detected, False, flags, x86)
        lacks = " ".join(probe.missing(requested)) or "an x86-64 CPU"
        raise ValueError(f"{ENV}={requested}: this CPU lacks {lacks} (its best tier is "
                         f"{detected})")
    return IsaChoice(requested, detected, requested != detected, flags, x86)


@functools.cache
def current() -> IsaChoice:
    """This process's choice, read once."""
    return choose()


def cap_torch_dispatch() -> None:
    """Under a forced tier, cap ATen's and oneDNN's own kernel choice to it too (they read these
    variables when torch first dispatches, so this runs before conveyor imports torch); a value
    the user set is kept."""
    requested = os.environ.get(ENV, "").strip().lower()
    if requested in TIERS:
        os.environ.setdefault("ATEN_CPU_CAPABILITY", ATEN_CAPABILITY[requested])
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", ONEDNN_MAX_ISA[requested])
