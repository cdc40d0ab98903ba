"""Streaming safetensors I/O: read one tensor (or a band of its rows) at a time, write shards as we go.

The safetensors format is ``u64 little-endian header length`` + a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, offsets
relative to the end of the header) + the tensor bytes, contiguous.

Reading uses ``readinto`` on the file (no mmap), so resident memory is the
buffer we ask for, never the file. Writing plans every shard's header first
(all output shapes and dtypes are known before any tensor is read), then
fills tensor data in place with ``os.pwrite`` in whatever order the input is
read -- the output bytes do not depend on that order.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ditq.errors import InputError

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "OutputTensor",
    "SafetensorsHeader",
    "ShardSetWriter",
    "TensorEntry",
    "read_header",
    "read_rows",
    "read_tensor",
]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    data_start: int
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]

    def in_file_order(self) -> list[TensorEntry]:
        return sorted(self.entries.values(), key=lambda e: (e.begin, e.name))


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and check a safetensors header: known dtypes, sizes that match shapes, data inside the file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise InputError(f"{path}: truncated safetensors file (no header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER, size - 8):
            raise InputError(f"{path}: corrupt or truncated safetensors header")
        raw = handle.read(header_len)
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: corrupt safetensors header ({error})") from error
    if not isinstance(doc, dict):
        raise InputError(f"{path}: corrupt safetensors header")
    data_start = 8 + header_len
    metadata = doc.pop("__metadata__", None) or {}
    entries: dict[str, TensorEntry] = {}
    for name, info in doc.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise InputError(
                f"{path}: tensor {name}: unsupported or malformed header entry ({error})"
            ) from error
        expected = dtype.itemsize * _numel(shape)
        if end - begin != expected or begin < 0:
            raise InputError(f"{path}: tensor {name}: {end - begin} bytes for shape {list(shape)}")
        if data_start + end > size:
            raise InputError(f"{path}: truncated: tensor {name} ends past the end of the file")
        entries[name] = TensorEntry(name, dtype, shape, data_start + begin, data_start + end)
    return SafetensorsHeader(path, data_start, entries, dict(metadata))


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _read_exact(handle, offset: int, nbytes: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``nbytes`` bytes at ``offset`` as a uint8 tensor (one allocation, no mmap)."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    handle.seek(offset)
    got = handle.readinto(buffer.numpy()) if nbytes else 0
    if got != nbytes:
        raise InputError(f"{handle.name}: truncated while reading {nbytes} bytes at offset {offset}")
    return buffer


def read_tensor(handle, entry: TensorEntry) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The whole tensor ``entry`` from an open binary file handle."""
    return _read_exact(handle, entry.begin, entry.nbytes).view(entry.dtype).reshape(entry.shape)


def read_rows(handle, entry: TensorEntry, rows_per_band: int) -> Iterator[tuple[int, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """Bands of rows of a tensor (first dim), as (first row, (rows, ...) tensor); one band in memory at a time."""
    n_rows = entry.shape[0] if entry.shape else 1
    row_shape = entry.shape[1:]
    row_bytes = entry.dtype.itemsize * _numel(row_shape)
    for first in range(0, n_rows, rows_per_band):
        rows = min(rows_per_band, n_rows - first)
        band = _read_exact(handle, entry.begin + first * row_bytes, rows * row_bytes)
        yield first, band.view(entry.dtype).reshape(rows, *row_shape)


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the output, known before its data exists."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * _numel(self.shape)


def _layout(tensors: list[OutputTensor]) -> tuple[bytes, dict[str, int]]:
    """(header bytes incl. length prefix, name -> absolute data offset), widest dtypes first for alignment."""
    ordered = sorted(tensors, key=lambda t: (-t.dtype.itemsize, t.name))
    doc: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    relative: dict[str, int] = {}
    for tensor in ordered:
        doc[tensor.name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        relative[tensor.name] = offset
        offset += tensor.nbytes
    header = json.dumps(doc, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    prefix = struct.pack("<Q", len(header)) + header
    return prefix, {name: len(prefix) + rel for name, rel in relative.items()}


class ShardSetWriter:
    """Writes a planned set of safetensors shards; tensor data arrives in any order, in row bands.

    ``shards`` maps file name -> the tensors it holds. Every file is created
    at its final size with its header; ``write`` puts bytes at a tensor's
    offset (plus a byte offset inside it, for row bands).
    """

    def __init__(self, folder: Path, shards: dict[str, list[OutputTensor]]) -> None:
        self._fds: dict[str, int] = {}
        self._where: dict[str, tuple[int, int, int]] = {}  # name -> (fd, offset, nbytes)
        self._written: dict[str, int] = {}
        for file_name, tensors in shards.items():
            prefix, offsets = _layout(tensors)
            fd = os.open(Path(folder) / file_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds[file_name] = fd
            os.pwrite(fd, prefix, 0)
            os.ftruncate(fd, len(prefix) + sum(t.nbytes for t in tensors))
            for tensor in tensors:
                self._where[tensor.name] = (fd, offsets[tensor.name], tensor.nbytes)
                self._written[tensor.name] = 0

    def write(self, name: str, data: torch.Tensor, byte_offset: int = 0) -> None:
        """Write ``data`` (contiguous, any dtype) into tensor ``name`` starting ``byte_offset`` bytes in."""
        fd, offset, nbytes = self._where[name]
        raw = data.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
        if byte_offset + raw.nbytes > nbytes:
            raise ValueError(f"{name}: write of {raw.nbytes} bytes at {byte_offset} overflows {nbytes}")
        view = raw.data  # memoryview over the bytes
        done = 0
        while done < raw.nbytes:
            done += os.pwrite(fd, view[done:], offset + byte_offset + done)
        self._written[name] += raw.nbytes

    def close(self) -> None:
        """fsync and close every shard; every tensor must have been written in full."""
        missing = [n for n, (_, _, size) in self._where.items() if self._written[n] != size]
        for fd in self._fds.values():
            os.fsync(fd)
            os.close(fd)
        self._fds.clear()
        if missing:
            raise RuntimeError(f"incomplete output tensors: {', '.join(sorted(missing)[:5])}")

    def abort(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
