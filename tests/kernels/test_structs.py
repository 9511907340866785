"""``kernels/structs.py``'s ctypes copies of ``csrc/stack.h``'s structs are laid out as the
compiler lays out the originals (``csrc/layout.c`` tells), at every tier this machine runs: a
field added on one side only, or a limit changed on one, fails here rather than shifting what
the kernels read. (Sizes and offsets cannot see a field that fits in a struct's padding at its
end, an int32 after an odd number of them before a pointer's alignment, say.)"""

from __future__ import annotations

import ctypes

import pytest

from conveyor.kernels import isa, structs
from conveyor.kernels.library import load_library
from conveyor.kernels.signatures import bind

NATIVE = isa.current().detected
RUNNABLE = isa.TIERS[:isa.TIERS.index(NATIVE) + 1]


def c_layout(tier: str):
    lib = load_library(tier)
    assert lib is not None
    fn = bind(lib, "struct_layout")
    return lambda name: fn(name.encode())


def differences(struct: type[ctypes.Structure], name: str, layout) -> list[str]:
    """Where the copy ``struct`` of C's ``name`` is laid out otherwise than C lays it out."""
    found = [] if layout(name) == ctypes.sizeof(struct) else [
        f"size {ctypes.sizeof(struct)}, C's {layout(name)}"]
    for field, _ in struct._fields_:
        if layout(f"{name}.{field}") != getattr(struct, field).offset:
            found.append(f"{field} at {getattr(struct, field).offset}, C's at "
                         f"{layout(f'{name}.{field}')}")
    return found


@pytest.mark.parametrize("tier", RUNNABLE)
def test_the_ctypes_structs_are_laid_out_as_the_c_ones(tier):
    layout = c_layout(tier)
    assert layout("MAX_RUNS") == structs.MAX_RUNS
    assert layout("NoSuchStruct") == layout("Layer.no_such_field") == -1
    for struct in structs.STRUCTS:
        assert differences(struct, struct.__name__, layout) == [], struct.__name__


def test_a_field_added_or_dropped_on_one_side_is_seen():
    layout = c_layout(NATIVE)
    for struct in structs.STRUCTS:
        name, fields = struct.__name__, struct._fields_
        for changed in ([*fields, ("extra", ctypes.c_int64)],             # one more, at the end
                        [*fields[:1], ("extra", ctypes.c_int64), *fields[1:]],  # in between
                        fields[1:]):                                      # the first one gone
            copy = type(name, (ctypes.Structure,), {"_fields_": changed})
            assert differences(copy, name, layout), (name, changed)
