"""Reading safetensors files one tensor at a time with plain reads (no memory map).

A memory-mapped file counts its touched pages in the process's resident set
until it is unmapped, so loading through a map can double what a load appears
to hold. Here each tensor is read with ``readinto`` straight into its own
freshly allocated storage: while loading, the process holds the tensors it
has assigned plus the one being read, nothing else. Every structural
problem (truncated header, bad JSON, unknown dtype, offsets past the end of
the file, a size that does not match the shape) is an InputError naming the
file and the tensor.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ditq.errors import InputError

__all__ = ["SAFETENSORS_DTYPES", "TensorEntry", "read_header", "read_tensor"]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: absolute [begin, end) in ``path``."""

    path: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Tensor name -> entry, validated against the file's size."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise InputError(f"{path}: truncated safetensors file (no header length)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER, size - 8):
            raise InputError(
                f"{path}: corrupt safetensors header length {header_len} (file has {size} bytes)"
            )
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: corrupt safetensors header ({error})") from error
    if not isinstance(header, dict):
        raise InputError(f"{path}: corrupt safetensors header (not an object)")
    data_start = 8 + header_len
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, info, data_start, size)
    return entries


def _entry(path: Path, name: str, info: object, data_start: int, size: int) -> TensorEntry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise InputError(f"{path}: tensor {name!r} has a malformed header entry")
    dtype = SAFETENSORS_DTYPES.get(str(info["dtype"]))
    if dtype is None:
        raise InputError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
    shape = tuple(int(v) for v in info["shape"])
    begin, end = (int(v) for v in info["data_offsets"])
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if end - begin != expected or begin < 0:
        raise InputError(
            f"{path}: tensor {name!r} holds {end - begin} bytes, its shape {shape} needs {expected}"
        )
    if data_start + end > size:
        raise InputError(f"{path}: tensor {name!r} runs past the end of the file (truncated artifact?)")
    return TensorEntry(path, name, dtype, shape, data_start + begin, data_start + end)


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """One tensor, read into fresh CPU memory."""
    flat = torch.empty(entry.nbytes, dtype=torch.uint8)
    with open(entry.path, "rb") as handle:
        handle.seek(entry.begin)
        got = handle.readinto(flat.numpy().data) if entry.nbytes else 0
    if got != entry.nbytes:
        raise InputError(f"{entry.path}: tensor {entry.name!r} is truncated ({got} of {entry.nbytes} bytes)")
    return flat.view(entry.dtype).reshape(entry.shape)


def iter_tensors(entries: dict[str, TensorEntry]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) in file order, one at a time."""
    for entry in sorted(entries.values(), key=lambda e: (str(e.path), e.begin)):
        yield entry.name, read_tensor(entry)
