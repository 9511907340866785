"""The C entry points' ctypes signatures, read from ``csrc/kernels.h``, where each is declared
once (and checked by the compiler against its definition), so that no Python list restates
them."""

from __future__ import annotations

import ctypes
import functools
import re
from pathlib import Path

import torch

HEADER = Path(__file__).with_name("csrc") / "kernels.h"
_SCALARS = {"int": ctypes.c_int, "int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64,
            "float": ctypes.c_float, "double": ctypes.c_double}
_RETURNS = {"void": None, **_SCALARS}
# the header's CONVEYOR_KERNELS instances: an entry point of each dtype, by its suffix
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _argtype(declaration: str):
    if "*" in declaration:  # (every pointer goes as an address)
        return ctypes.c_void_p
    return _SCALARS[declaration.replace("const ", "").split()[0]]


@functools.cache
def signatures() -> dict[str, tuple[list, type | None]]:
    """Entry point name -> (argtypes, restype), the dtype macro's instances expanded as the
    preprocessor expands them."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S).replace("\\\n", " ")
    macro = re.search(r"#define CONVEYOR_KERNELS\(T, E\)(.*)", text)
    text = text.replace(macro[0], "")
    text = re.sub(r"CONVEYOR_KERNELS\((\w+), (\w+)\)",
                  lambda m: re.sub(r"\bE\b", m[2], macro[1].replace("##T", m[1])), text)
    found = {}
    for restype, name, args in re.findall(r"\b(int|void|double)\s+(\w+)\(([^)]*)\);", text):
        argtypes = [] if args.strip() == "void" else [_argtype(a) for a in args.split(",")]
        found[name] = argtypes, _RETURNS[restype]
    return found


def bind(lib: ctypes.CDLL, name: str):
    """The library's entry point ``name``, with the header's signature."""
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = signatures()[name]
    return fn


def entry(lib: ctypes.CDLL, name: str, dtype: torch.dtype):
    """The entry point ``name`` of ``dtype`` (``quant_linear`` -> ``quant_linear_f32``)."""
    return bind(lib, f"{name}_{SUFFIX[dtype]}")


def has_entry(lib: ctypes.CDLL, name: str, dtype: torch.dtype) -> bool:
    return hasattr(lib, f"{name}_{SUFFIX[dtype]}")
