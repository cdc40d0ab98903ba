"""Streaming safetensors I/O: read one tensor (or a band of its rows) at a time, write shards as we go.

The safetensors format is ``u64 little-endian header length`` + a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, offsets
relative to the end of the header) + the tensor bytes, contiguous.

Reading uses ``readinto`` on the file (no mmap), so resident memory is the
buffer we ask for, never the file. Writing plans every shard's header first
(all output shapes and dtypes are known before any tensor is read), then
appends tensor data in that order as it is produced, hashing as it goes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import BinaryIO, TypeGuard

import torch

from ditq.errors import InputError
from ditq.fsutil import open_regular
from ditq.jsonfile import JsonRefused, loads

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "MAX_HEADER_BYTES",
    "MAX_TENSORS_PER_FILE",
    "OutputTensor",
    "SafetensorsHeader",
    "ShardSetWriter",
    "TensorEntry",
    "read_entry",
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
# What ditq reads of a header, checked before it is parsed (a parsed entry costs about 1 KB of Python objects).
# A shard of a real model lists a few thousand tensors in well under 1 MiB.
MAX_HEADER_BYTES = 16 * 1024**2
MAX_TENSORS_PER_FILE = 100_000


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int
    path: Path  # the file that holds it

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
        """Entries by offset; an empty tensor sorts before a tensor that starts where it does."""
        return sorted(self.entries.values(), key=lambda e: (e.begin, e.end, e.name))


def _read_header_bytes(path: Path) -> tuple[bytes, int]:
    """The raw JSON header and the file's size; a header over the bounds is refused before it is read."""
    with open_regular(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise InputError(f"{path}: truncated safetensors file (no header)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise InputError(
                f"{path}: safetensors header of {header_len} bytes, over the {MAX_HEADER_BYTES} ditq reads "
                "(a corrupt file?)"
            )
        if header_len > size - 8:
            raise InputError(f"{path}: corrupt or truncated safetensors header")
        raw = handle.read(header_len)
    # Every entry (and __metadata__) is a JSON object inside the header's own, and an object cannot be spelled
    # without "{": a bound on the entries that no escape in a name can get around.
    if raw.count(b"{") - 1 > MAX_TENSORS_PER_FILE:
        raise InputError(
            f"{path}: safetensors header lists more than the {MAX_TENSORS_PER_FILE} tensors ditq reads"
        )
    return raw, size


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and check a safetensors header: known dtypes, sizes that match shapes, data inside the file."""
    path = Path(path)
    raw, size = _read_header_bytes(path)
    try:
        doc = loads(raw)  # bounded as every JSON ditq reads: nesting, integer length, each tensor named once
    except JsonRefused as error:
        raise InputError(f"{path}: corrupt safetensors header ({error})") from None
    if not isinstance(doc, dict):
        raise InputError(f"{path}: corrupt safetensors header")
    data_start = 8 + len(raw)
    metadata = doc.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError(f"{path}: __metadata__ is not an object of strings")
    entries: dict[str, TensorEntry] = {}
    for name, info in doc.items():
        if not isinstance(info, dict) or info.get("dtype") not in DTYPES:
            dtype_name = info.get("dtype") if isinstance(info, dict) else None
            raise InputError(
                f"{path}: tensor {name}: unsupported or malformed header entry (dtype {dtype_name!r})"
            )
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not _naturals(shape):
            raise InputError(f"{path}: tensor {name}: shape {shape!r} is not a list of whole numbers")
        if not _naturals(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            raise InputError(f"{path}: tensor {name}: data_offsets {offsets!r} is not [begin, end]")
        dtype, (begin, end) = DTYPES[info["dtype"]], offsets
        if end - begin != dtype.itemsize * _numel(tuple(shape)):
            raise InputError(f"{path}: tensor {name}: {end - begin} bytes for shape {list(shape)}")
        if data_start + end > size:
            raise InputError(f"{path}: tensor {name!r} runs past the end of the file (truncated)")
        entries[name] = TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end, path)
    header = SafetensorsHeader(path, data_start, entries, dict(metadata))
    ordered = header.in_file_order()
    for before, after in pairwise(ordered):
        if after.begin < before.end:
            raise InputError(f"{path}: tensors {before.name!r} and {after.name!r} overlap in the file")
    return header


def _naturals(value: object) -> TypeGuard[list[int]]:
    """Whether ``value`` is a list of non-negative integers (no floats, booleans or strings: ``2.0`` is refused)."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _read_exact(handle, offset: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes at ``offset`` as a uint8 tensor (one allocation, no mmap)."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    handle.seek(offset)
    got = handle.readinto(buffer.numpy()) if nbytes else 0
    if got != nbytes:
        raise InputError(f"{handle.name}: truncated while reading {nbytes} bytes at offset {offset}")
    return buffer


def read_tensor(handle, entry: TensorEntry) -> torch.Tensor:
    """The whole tensor ``entry`` from an open binary file handle."""
    return _read_exact(handle, entry.begin, entry.nbytes).view(entry.dtype).reshape(entry.shape)


def read_entry(entry: TensorEntry) -> torch.Tensor:
    """The whole tensor ``entry``, read from its file into fresh CPU memory."""
    with open_regular(entry.path) as handle:
        return read_tensor(handle, entry)


def read_rows(handle, entry: TensorEntry, rows_per_band: int) -> Iterator[tuple[int, torch.Tensor]]:
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


def _header(tensors: list[OutputTensor]) -> bytes:
    """Length prefix + JSON header for ``tensors`` laid out contiguously in the given order."""
    doc: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        doc[tensor.name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    header = json.dumps(doc, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


class ShardSetWriter:
    """Writes a planned set of safetensors shards front to back, hashing every byte on the way.

    ``shards`` maps file name -> its tensors in file order. Data must arrive
    in exactly that order (a tensor may come in several pieces, e.g. row
    bands); each file's header is written when the file is opened. ``close``
    returns each file's (size, sha256) without reading anything back.
    """

    def __init__(self, folder: Path, shards: dict[str, list[OutputTensor]]) -> None:
        self._folder = Path(folder)
        self._queue = [(file_name, tensor) for file_name, tensors in shards.items() for tensor in tensors]
        self._shards = shards
        self._position = 0  # index into _queue of the tensor being written
        self._filled = 0  # bytes of it written so far
        self._file_name: str | None = None
        self._handle: BinaryIO | None = None
        self._hasher = hashlib.sha256()
        self._size = 0
        self.digests: dict[str, tuple[int, str]] = {}

    def _emit(self, data: memoryview | bytes) -> None:
        assert self._handle is not None
        self._handle.write(data)
        self._hasher.update(data)
        self._size += len(data)

    def _finish_file(self) -> None:
        if self._handle is not None and self._file_name is not None:
            self._handle.flush()
            os.fsync(self._handle.fileno())
            self._handle.close()
            self.digests[self._file_name] = (self._size, self._hasher.hexdigest())
            self._handle = None

    def _open(self, file_name: str) -> None:
        if file_name != self._file_name:
            self._finish_file()
            self._file_name, self._hasher, self._size = file_name, hashlib.sha256(), 0
            self._handle = open(self._folder / file_name, "wb")  # noqa: SIM115 - closed in _finish_file
            self._emit(_header(self._shards[file_name]))

    def _pass_empty(self) -> None:
        """Step over planned tensors of no bytes (shape [0]): their header entry is all they are."""
        while self._position < len(self._queue) and self._queue[self._position][1].nbytes == 0:
            self._open(self._queue[self._position][0])
            self._position += 1

    def write(self, name: str, data: torch.Tensor) -> None:
        """Append the next bytes of tensor ``name`` (which must be the tensor being written)."""
        raw = data.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
        if raw.nbytes == 0:
            return
        self._pass_empty()
        file_name, tensor = self._queue[self._position]
        if name != tensor.name:
            raise RuntimeError(f"output order broken: got {name}, expected {tensor.name}")
        self._open(file_name)
        if self._filled + raw.nbytes > tensor.nbytes:
            raise RuntimeError(f"{name}: {self._filled + raw.nbytes} bytes written, {tensor.nbytes} planned")
        self._emit(raw.data)
        self._filled += raw.nbytes
        if self._filled == tensor.nbytes:
            self._position, self._filled = self._position + 1, 0

    def close(self) -> dict[str, tuple[int, str]]:
        """Finish the last file; every planned tensor must have been written in full."""
        self._pass_empty()
        if self._position != len(self._queue):
            raise RuntimeError(f"output incomplete at {self._queue[self._position][1].name}")
        self._finish_file()
        return self.digests

    def abort(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
