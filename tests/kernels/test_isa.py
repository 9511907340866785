"""The start-up choice follows the CPU's flags: the tier, the dtype ``auto`` picks, oneDNN's
bfloat16 prepacking, and the one-line refusals (fed fake flag sets, and forced tiers)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from cli_output import error_lines
from conveyor.config import EngineConfig
from conveyor.kernels import build, isa
from conveyor.model import backend

AVX2 = frozenset("sse4_2 avx avx2 fma f16c bmi2".split())            # AMD EPYC (Zen 2-3)
SKYLAKE_X = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}  # AVX-512, no BF16
COOPER_LAKE = SKYLAKE_X | {"avx512_bf16", "avx512_vnni"}
SAPPHIRE_RAPIDS = COOPER_LAKE | {"amx_tile", "amx_bf16", "amx_int8"}
CPU = torch.device("cpu")


@pytest.mark.parametrize("flags,tier", [
    (frozenset(), "generic"), (frozenset({"avx", "sse4_2"}), "generic"),
    (frozenset({"avx2", "fma"}), "generic"),  # no F16C: not the avx2 tier
    (AVX2, "avx2"), (SKYLAKE_X, "avx2"), (COOPER_LAKE, "avx512"), (SAPPHIRE_RAPIDS, "amx"),
    (SKYLAKE_X | {"avx512_bf16"}, "avx2"),  # no VNNI: the integer linears' instructions
    (AVX2 | {"amx_tile", "amx_bf16"}, "avx2"),  # a tier needs every tier's flags below it
])
def test_tier_follows_the_flags(flags, tier):
    choice = isa.choose(flags, "", machine="x86_64")
    assert (choice.tier, choice.detected, choice.forced) == (tier, tier, False)
    assert choice.native_bf16 == (tier in ("avx512", "amx"))
    assert choice.describe().startswith(tier)


def test_other_architectures_get_the_generic_tier():
    arm = isa.choose(frozenset({"fp", "asimd", "bf16"}), "", machine="aarch64")
    assert arm.tier == "generic" and arm.native_bf16  # ARM's BF16: bfloat16 is native there
    assert not isa.choose(frozenset({"fp", "asimd"}), "", machine="aarch64").native_bf16


def test_a_lower_tier_can_be_forced_and_a_higher_one_is_refused():
    forced = isa.choose(SAPPHIRE_RAPIDS, "avx2", machine="x86_64")
    assert (forced.tier, forced.detected, forced.forced) == ("avx2", "amx", True)
    assert not forced.native_bf16 and "CONVEYOR_CPU_ISA" in forced.describe()
    with pytest.raises(ValueError, match="lacks avx512f .*avx512_bf16.*avx512_vnni"):
        isa.choose(AVX2, "avx512", machine="x86_64")
    with pytest.raises(ValueError, match="expected one of"):
        isa.choose(AVX2, "sse9", machine="x86_64")


def test_reads_this_machines_flags():
    flags = isa.cpu_flags()
    if isa.is_x86():
        assert "sse2" in flags  # every x86-64 CPU has it
    assert isa.current().detected == isa.best_tier(flags, isa.is_x86())


@pytest.fixture
def cpu_of(monkeypatch):
    """Make this process see a CPU with the given flags (and forced tier)."""

    def use(flags: frozenset[str], forced: str = "") -> isa.IsaChoice:
        choice = isa.choose(flags, forced, machine="x86_64")
        monkeypatch.setattr(isa, "current", lambda: choice)
        return choice

    return use


@pytest.mark.parametrize("flags,forced,dtype", [
    (AVX2, "", torch.float32), (SKYLAKE_X, "", torch.float32), (COOPER_LAKE, "", torch.bfloat16),
    (SAPPHIRE_RAPIDS, "", torch.bfloat16), (SAPPHIRE_RAPIDS, "avx2", torch.float32),
    (SAPPHIRE_RAPIDS, "generic", torch.float32),
])
def test_dtype_auto_follows_the_tier(cpu_of, flags, forced, dtype):
    cpu_of(flags, forced)
    config = EngineConfig()
    assert config.torch_dtype(None, CPU) == dtype
    assert config.torch_dtype("bfloat16", CPU) == dtype  # a bf16 checkpoint computes the same
    assert config.torch_dtype("float32", CPU) == torch.float32
    assert ("natively" in config.dtype_reason(None, CPU)) == (dtype == torch.bfloat16)
    # oneDNN's bfloat16 prepacking only where the tier computes bfloat16
    if dtype == torch.float32:
        assert not backend.can_prepack(CPU, torch.bfloat16)


def test_explicit_bfloat16_without_it_is_refused_in_one_line(cpu_of):
    cpu_of(SAPPHIRE_RAPIDS, "avx2")
    with pytest.raises(ValueError) as e:
        EngineConfig(dtype="bfloat16", device="cpu")
    message = str(e.value)
    assert "\n" not in message and "AVX512_BF16" in message and "avx2" in message
    assert EngineConfig(dtype="float32").torch_dtype(None, CPU) == torch.float32
    cpu_of(SAPPHIRE_RAPIDS)
    assert EngineConfig(dtype="bfloat16", device="cpu").torch_dtype(None, CPU) == torch.bfloat16


def test_cli_refuses_bfloat16_on_a_forced_avx2_tier_with_one_line():
    env = {"CONVEYOR_CPU_ISA": "avx2", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "conveyor.cli", "generate", "--dtype", "bfloat16",
                           "--max-tokens", "1"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 2
    lines = error_lines(done.stderr)
    assert len(lines) == 1 and lines[0].startswith("conveyor: error: dtype bfloat16 needs")


def test_a_tier_builds_the_highest_file_of_each_name():
    names = {p.name: p.parent.name for p in build.tier_sources("avx2")}
    assert names["quant_linear_f32.c"] == "avx2" and names["rms_norm.c"] == "generic"
    assert "quant_linear_bf16.c" not in names  # bfloat16 kernels from the avx512 tier on
    assert {p.parent.name for p in build.tier_sources("generic")} <= {"generic", "csrc"}
    assert dict((p.name, p.parent.name) for p in build.tier_sources("amx"))[
        "quant_linear_bf16.c"] == "avx512"


def test_head_dims_the_vectorised_attention_cannot_take_fall_back_with_a_reason():
    from conveyor.kernels.library import unavailable
    assert unavailable(torch.float32, 64, "avx2") is None
    assert "head_dim" in unavailable(torch.float32, 260, "avx2")
    assert "head_dim" in unavailable(torch.float32, 36, "avx512")
    assert unavailable(torch.float32, 36, "generic") is None  # the plain-C loop takes any
