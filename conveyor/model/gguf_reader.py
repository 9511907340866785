"""A lean GGUF reader: the header, the metadata the loader asks for and the tensor table, over a
memory map of the file; no tensor data is read.

gguf-py's reader turns every metadata value into numpy views item by item, a vocabulary's ~50k
strings and merges included: seconds for a small model's file (most of its load), and it runs
past the end of a truncated file silently. This one walks the metadata once, keeps where each
value lies, and decodes a value only when it is asked for; every read is checked against the
file's size, so a truncated or corrupted file is one ValueError, never an IndexError or a loop
on a corrupted length.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

VT = gguf.GGUFValueType
_SCALARS = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I",
            VT.INT32: "<i", VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q",
            VT.FLOAT64: "<d"}
_NUMPY = {VT.UINT8: "<u1", VT.INT8: "<i1", VT.UINT16: "<u2", VT.INT16: "<i2", VT.UINT32: "<u4",
          VT.INT32: "<i4", VT.FLOAT32: "<f4", VT.BOOL: "?", VT.UINT64: "<u8", VT.INT64: "<i8",
          VT.FLOAT64: "<f8"}
VERSIONS = (2, 3)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # rows first (the file lists the innermost dimension first)
    offset: int             # of its data, from the start of the file
    nbytes: int


class GGUFFile:
    """A parsed GGUF file: ``metadata`` keys, ``tensors`` (in table order), and ``tensor_bytes``
    (a tensor's data as a view of the file's memory map, copy-on-write: writing it never
    reaches the file)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            # copy-on-write: the arrays are writable (as torch wants them), the file never is
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if os.fstat(
                f.fileno()).st_size else None
        self.data = np.frombuffer(self._map, np.uint8) if self._map else np.zeros(0, np.uint8)
        self.size = int(self.data.size)
        self._buf = memoryview(self.data)
        self._fields: dict[str, tuple[VT, int]] = {}  # key -> (type, offset of its value)
        if self._read("<I", 0) != gguf.GGUF_MAGIC:
            raise ValueError("no GGUF magic at the start of the file")
        version = self._read("<I", 4)
        if version not in VERSIONS:
            hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise ValueError(f"GGUF version {version} is not supported{hint}")
        tensor_count, kv_count = self._read("<Q", 8), self._read("<Q", 16)
        offset = 24
        for _ in range(kv_count):
            key, offset = self._string(offset)
            kind, offset = self._type(offset)
            if key in self._fields:
                raise ValueError(f"metadata key {key!r} appears twice")
            self._fields[key] = (kind, offset)
            offset = self._skip(kind, offset)
        infos = []
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            n_dims = self._read("<I", offset)
            dims = self._array("<u8", offset + 4, n_dims).tolist()
            offset += 4 + 8 * n_dims
            raw_type, relative = self._read("<I", offset), self._read("<Q", offset + 4)
            offset += 12
            infos.append((name, dims, raw_type, relative))
        self.alignment = self.value("general.alignment", 32)
        if (self._fields.get("general.alignment", (VT.UINT32,))[0] != VT.UINT32
                or self.alignment <= 0 or self.alignment & (self.alignment - 1)):
            raise ValueError(f"general.alignment {self.alignment!r} is not a power of two")
        self.data_offset = -(-offset // self.alignment) * self.alignment
        self.tensors: list[TensorInfo] = []
        for name, dims, raw_type, relative in infos:
            self.tensors.append(self._tensor(name, dims, raw_type, relative))
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("a tensor name appears twice")

    @property
    def keys(self) -> list[str]:
        return list(self._fields)

    def value(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python has it (str, int, float, bool, or a list of them), or
        default when the key is absent."""
        if key not in self._fields:
            return default
        kind, offset = self._fields[key]
        if kind == VT.STRING:
            return self._text(key, offset)
        if kind != VT.ARRAY:
            return self._read(_SCALARS[kind], offset)
        item, count = self._type(offset)[0], self._read("<Q", offset + 4)
        if item in _NUMPY:
            return self._array(_NUMPY[item], offset + 12, count).tolist()
        if item != VT.STRING:
            raise ValueError(f"GGUF metadata {key!r} is an array of {item.name}, not read")
        out, at = [], offset + 12
        for _ in range(count):
            out.append(self._text(key, at))
            at += 8 + self._read("<Q", at)
        return out

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        """The tensor's data: uint8 [nbytes], a view of the file's map."""
        return self.data[t.offset:t.offset + t.nbytes]

    def release(self, t: TensorInfo) -> None:
        """Give back the pages of the map that hold only this tensor (after it was copied):
        they leave this process's resident memory (the file stays in the page cache)."""
        page = mmap.PAGESIZE
        start, end = -(-t.offset // page) * page, (t.offset + t.nbytes) // page * page
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    # -- reading, bounded ------------------------------------------------------------------------
    def _past_end(self, offset: int, end: int) -> ValueError:
        return ValueError(f"{end - offset} bytes at offset {offset} run past the end of the "
                          f"file ({self.size} bytes): truncated or corrupted")

    def _read(self, fmt: str, offset: int) -> Any:
        end = offset + struct.calcsize(fmt)
        if end > self.size:
            raise self._past_end(offset, end)
        return struct.unpack_from(fmt, self._buf, offset)[0]

    def _array(self, dtype: str, offset: int, count: int) -> np.ndarray:
        end = offset + np.dtype(dtype).itemsize * count
        if end > self.size:
            raise self._past_end(offset, end)
        return np.frombuffer(self._buf, dtype, count, offset)

    def _string(self, offset: int) -> tuple[str, int]:
        length = self._read("<Q", offset)
        if offset + 8 + length > self.size:
            raise self._past_end(offset, offset + 8 + length)
        try:
            text = bytes(self._buf[offset + 8:offset + 8 + length]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"a name at offset {offset} is not UTF-8") from e
        return text, offset + 8 + length

    def _text(self, key: str, offset: int) -> str:
        length = self._read("<Q", offset)
        try:
            return bytes(self._buf[offset + 8:offset + 8 + length]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"GGUF metadata {key!r} is unreadable: not UTF-8") from e

    def _type(self, offset: int) -> tuple[VT, int]:
        raw = self._read("<I", offset)
        try:
            return VT(raw), offset + 4
        except ValueError:
            raise ValueError(f"unknown metadata value type {raw} at offset {offset}") from None

    def _skip(self, kind: VT, offset: int) -> int:
        """The offset after a value of this type at offset."""
        if kind in _SCALARS:
            end = offset + struct.calcsize(_SCALARS[kind])
        elif kind == VT.STRING:
            end = offset + 8 + self._read("<Q", offset)
        else:
            item, count = self._type(offset)[0], self._read("<Q", offset + 4)
            offset += 12
            if item in _SCALARS:
                end = offset + struct.calcsize(_SCALARS[item]) * count
            elif item == VT.STRING:  # at least 8 bytes each: checked before the walk
                if offset + 8 * count > self.size:
                    raise self._past_end(offset, offset + 8 * count)
                for _ in range(count):
                    offset += 8 + self._read("<Q", offset)
                end = offset
            else:
                raise ValueError(f"metadata arrays of {item.name} are not supported")
        if end > self.size:
            raise self._past_end(offset, end)
        return end

    def _tensor(self, name: str, dims: list[int], raw_type: int, relative: int) -> TensorInfo:
        try:
            kind = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name} has unknown ggml type {raw_type}") from None
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        if dims and dims[0] % block:
            raise ValueError(f"tensor {name}: rows of {dims[0]} values are not a multiple of "
                             f"{kind.name} block size ({block})")
        nbytes = int(np.prod(dims, dtype=object)) // block * block_bytes
        offset = self.data_offset + relative
        if offset + nbytes > self.size:
            raise self._past_end(offset, offset + nbytes)
        return TensorInfo(name, kind, tuple(reversed(dims)), offset, nbytes)
