"""Builds one tier's kernel library with the system C compiler, once, into a cache.

A tier's library is the sources of ``csrc/``: the files at its top (compositions of the
others, the same at every tier) and, for each kernel source name, the file of the highest
tier folder the tier reaches (``generic/quant_linear_f32.c`` is replaced by
``avx2/quant_linear_f32.c`` from the avx2 tier on). A new tier is a new folder, its flags
here, and its flags in ``isa.py``; no caller changes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path

from conveyor.kernels import isa

logger = logging.getLogger("conveyor")
PROGRESS_SECONDS = 10  # a line this often while the compiler runs (a first start is silent else)

SOURCES = Path(__file__).with_name("csrc")
# The folders a tier's library draws on, lowest first (AMX is the avx512 sources with the
# tiles turned on: their ``#if CONVEYOR_AMX`` paths).
FOLDERS = {"generic": ("generic",), "avx2": ("generic", "avx2"),
           "avx512": ("generic", "avx2", "avx512"), "amx": ("generic", "avx2", "avx512")}
_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
_AVX512 = _AVX2 + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                   "-mavx512vnni"]
# Instruction sets a tier compiles for, when it is not this CPU's own best (then -march=native).
TIER_FLAGS = {"generic": [], "avx2": _AVX2, "avx512": _AVX512,
              "amx": _AVX512 + ["-mamx-tile", "-mamx-bf16", "-mamx-int8"]}
# Fast math lets GCC vectorise the dot products and exp; it is not passed when linking, so the
# library does not switch the whole process to flush-to-zero. No contraction of a * b + c into
# one rounding where PyTorch rounds twice (rope, dequantizing); written FMAs stay FMAs.
COMPILE_FLAGS = ["-O3", "-ffast-math", "-ffp-contract=off", "-fopenmp", "-fPIC"]
LINK_FLAGS = ["-shared", "-fopenmp"]


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def tier_sources(tier: str) -> list[Path]:
    chosen: dict[str, Path] = {}
    for folder in FOLDERS[tier]:  # a higher tier's file replaces a lower one's of that name
        chosen.update({p.name: p for p in (SOURCES / folder).glob("*.c")})
    return sorted(SOURCES.glob("*.c")) + sorted(chosen.values())


def tier_flags(tier: str, choice: isa.IsaChoice) -> list[str]:
    """This CPU's own best tier is built for the CPU itself (its tuning and every extension it
    has); a lower one for exactly its instruction set, tuned for this CPU."""
    if not choice.x86:
        return COMPILE_FLAGS
    if tier == choice.detected:
        return COMPILE_FLAGS + ["-march=native"]
    return COMPILE_FLAGS + TIER_FLAGS[tier] + ["-mtune=native"]


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "conveyor" / "kernels"


def build(tier: str, choice: isa.IsaChoice, cc: str) -> Path:
    """The library for ``tier``, built if these sources, flags, compiler and CPU have none in
    the cache. Raises CalledProcessError (with the compiler's stderr) if it does not build."""
    sources = tier_sources(tier)
    flags = tier_flags(tier, choice)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             check=True).stdout
    texts = [p.read_text() for p in sources] + [p.read_text() for p in SOURCES.glob("*.h")]
    key = hashlib.sha256("\0".join([*texts, " ".join(flags + LINK_FLAGS), version,
                                    " ".join(sorted(choice.flags))]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"conveyor-kernels-{tier}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    logger.info("compiling the CPU kernels for the %s tier, once for this CPU and compiler "
                "(%d sources on %d cores; cached in %s)", tier, len(sources), _jobs(),
                target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [str(Path(tmp) / f"{i}-{src.stem}.o") for i, src in enumerate(sources)]
        with ThreadPoolExecutor(_jobs()) as pool:
            running = [pool.submit(subprocess.run, [cc, *flags, f"-I{SOURCES}", "-c", str(src),
                                                    "-o", obj],
                                   capture_output=True, text=True, check=True)
                       for src, obj in zip(sources, objects)]
            pending = set(running)
            while pending:
                done, pending = wait(pending, PROGRESS_SECONDS, FIRST_EXCEPTION)
                for job in done:
                    job.result()  # (raises the compiler's error)
                if pending:
                    logger.info("compiling the CPU kernels: %d of %d sources done, %.0f s",
                                len(sources) - len(pending), len(sources),
                                time.monotonic() - started)
        lib = Path(tmp) / "kernels.so"
        subprocess.run([cc, *LINK_FLAGS, *objects, "-o", str(lib), "-lm"],
                       capture_output=True, text=True, check=True)
        os.replace(lib, target)  # atomic: a concurrent build of the same key is harmless
    logger.info("compiled the CPU kernels for the %s tier in %.1f s", tier,
                time.monotonic() - started)
    return target


def _jobs() -> int:
    """Compilers run at once: this process's cores."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
