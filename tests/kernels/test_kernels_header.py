"""``csrc/kernels.h`` is the one list of the C entry points: every tier's library exports only
what it declares, the compiler holds each definition to it, and the ctypes signatures are read
from it."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from conveyor.kernels import build, isa, signatures
from conveyor.kernels.library import load_library

NATIVE = isa.current().detected
RUNNABLE = isa.TIERS[:isa.TIERS.index(NATIVE) + 1]


@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm (binutils) to list the symbols")
@pytest.mark.parametrize("tier", RUNNABLE)
def test_each_tier_exports_only_what_the_header_declares(tier):
    lib = load_library(tier)
    assert lib is not None
    listing = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True,
                             text=True, check=True).stdout
    exported = {line.split()[-1] for line in listing.splitlines() if line.split()[1] == "T"}
    declared = set(signatures.signatures())
    assert exported <= declared, f"not in kernels.h: {sorted(exported - declared)}"
    bf16 = isa.TIERS.index(tier) >= isa.TIERS.index("avx512")
    # the K-quants repacked for int8 (csrc/repacked.h) are the avx2 tier's alone
    repacks = {"repack_rows", "repacked_row_bytes"}
    want = {n for n in declared if (bf16 or not n.endswith("_bf16") and n != "has_amx")
            and (n not in repacks or tier == "avx2")}
    # (below avx512 a tier may export some bfloat16 entries too: the plain-C norms and GLUs)
    assert want - exported == set(), f"declared, not built at {tier}"
    assert (exported & repacks == repacks) == (tier == "avx2")


def test_signatures_expand_the_dtype_macro_and_map_the_c_types():
    sigs = signatures.signatures()
    assert sigs["quant_linear_f32"] == sigs["quant_linear_bf16"]
    argtypes, restype = sigs["paged_decode_attention_bf16"]
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    assert argtypes == [p, i64, p, p, i32, p, i64, p, p, i64, i32, i32, i32, i32, i32, f32, i32,
                        f32, i32] and restype is ctypes.c_int
    assert sigs["has_amx"] == ([], ctypes.c_int)
    assert sigs["fma_peak_gflops"] == ([ctypes.c_int, ctypes.c_double, ctypes.c_int],
                                       ctypes.c_double)
    assert sigs["argmax_rows"][1] is None


@pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
def test_a_definition_that_parts_from_the_header_does_not_compile(tmp_path):
    source = (build.SOURCES / "generic" / "glu.c").read_text()
    wrong = source.replace("void silu_mul_f32(float *gu, int64_t stride, int rows,",
                           "void silu_mul_f32(float *gu, int64_t stride, int64_t rows,")
    assert wrong != source
    for text, ok in ((source, True), (wrong, False)):
        path = tmp_path / "glu.c"
        path.write_text(text)
        done = subprocess.run([build.compiler(), "-fsyntax-only", f"-I{build.SOURCES}",
                               str(path)], capture_output=True, text=True)
        assert (done.returncode == 0) == ok, done.stderr
        if not ok:
            assert "conflicting types for" in done.stderr and "silu_mul_f32" in done.stderr
