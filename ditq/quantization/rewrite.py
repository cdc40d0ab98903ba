"""Rewrite one component's weights: quantize its targets band by band, copy every other tensor byte for byte.

The source files are read once, front to back. Each band of
rows is encoded on a worker thread (single-threaded torch inside each, which
keeps small bands in cache and avoids thread-pool thrash), and the results
are appended in source order, so the output -- hashed as it is written -- is
the same whatever the band size or thread count. Memory: at most
``2 x workers`` bands are in flight, whatever the tensor, shard or model size.

With a low-rank branch (``--low-rank R``, ``ditq.quantization.low_rank``) a target is read whole, split by its SVD,
and its residual encoded in the same bands; the branch's two tensors follow the codec's in the file.
"""

from __future__ import annotations

import json
import os
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ditq.checkpoint.codecs import SCALE, codec_for, is_quantized_tensor
from ditq.checkpoint.layout import weight_files
from ditq.checkpoint.low_rank import branch_rank
from ditq.checkpoint.safetensors_io import (
    OutputTensor,
    SafetensorsHeader,
    ShardSetWriter,
    TensorEntry,
    read_header,
    read_rows,
)
from ditq.checkpoint.stored import stored_specs
from ditq.errors import InputError
from ditq.fsutil import open_regular
from ditq.numerics import dequantize_weight, quantize_weight
from ditq.progress import progress_bar
from ditq.quantization.low_rank import split_low_rank
from ditq.quantization.targets import TargetPlan
from ditq.schemes import Scheme

__all__ = [
    "ComponentResult",
    "EncodedBand",
    "StoredLayer",
    "band_workers",
    "encode_band",
    "encode_weight",
    "read_component_headers",
    "rewrite_component",
    "weight_stem",
]

SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class ComponentResult:
    weight_files: list[str] = field(default_factory=list)  # written, relative to the component folder
    quantized_tensors: int = 0
    quantized_params: int = 0
    kept_params: int = 0
    errors: dict[str, float] = field(default_factory=dict)  # target prefix -> relative L2 error
    # target prefix -> (calibration rows left out of its Hessian, all its rows), where GPTQ left any out
    calibration_rows_left_out: dict[str, tuple[int, int]] = field(default_factory=dict)
    written_files: dict[str, tuple[int, str]] = field(default_factory=dict)  # file name -> (size, sha256)


def read_component_headers(
    component_dir: Path, variant: str | None = None
) -> dict[str, tuple[SafetensorsHeader, TensorEntry]]:
    """Tensor name -> (its file's header, its entry), over every weight file of the component (of ``variant``)."""
    where: dict[str, tuple[SafetensorsHeader, TensorEntry]] = {}
    for path in weight_files(component_dir, variant):
        header = read_header(path)
        for name, entry in header.entries.items():
            if name in where:
                raise InputError(f"{path}: tensor {name} also in {where[name][0].path.name}")
            where[name] = (header, entry)
    return where


def weight_stem(component_dir: Path, variant: str | None = None) -> str:
    """The file-name stem the source uses (``diffusion_pytorch_model``, ``model``), without its variant."""
    first = weight_files(component_dir, variant)[0].name
    return re.sub(r"(\.[^.-]+)?(-\d{5}-of-\d{5})?\.safetensors$", "", first)


def _check_source(entries: dict[str, tuple[SafetensorsHeader, TensorEntry]], plan: TargetPlan) -> None:
    for name, (header, entry) in entries.items():
        if is_quantized_tensor(name, entry.dtype):
            raise InputError(
                f"{header.path}: tensor {name} is already quantized; ditq quantizes BF16/FP16/FP32 models"
            )
    for prefix in plan.targets:
        header, entry = entries[f"{prefix}.weight"]
        if entry.dtype not in SOURCE_DTYPES:
            raise InputError(f"{header.path}: tensor {prefix}.weight has unsupported dtype {entry.dtype}")


def _outputs(
    name: str, entry: TensorEntry, plan: TargetPlan, schemes: Mapping[str, Scheme], low_rank: int
) -> list[OutputTensor]:
    prefix = name[: -len(".weight")]
    if name.endswith(".weight") and prefix in plan.targets:
        layer, scheme = plan.targets[prefix], schemes[prefix]
        specs = stored_specs(scheme, layer.out_features, layer.in_features, low_rank)
        return [OutputTensor(f"{prefix}.{local}", dtype, shape) for local, (dtype, shape) in specs.items()]
    return [OutputTensor(name, entry.dtype, entry.shape)]


def _plan_shards(
    groups: list[list[OutputTensor]], stem: str, max_shard_bytes: int
) -> dict[str, list[OutputTensor]]:
    """Split tensor groups (a Linear's tensors stay together) into shards of at most ``max_shard_bytes``."""
    shards: list[list[OutputTensor]] = [[]]
    size = 0
    for group in groups:
        group_bytes = sum(t.nbytes for t in group)
        if shards[-1] and size + group_bytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(group)
        size += group_bytes
    if len(shards) == 1:
        return {f"{stem}.safetensors": shards[0]}
    n = len(shards)
    return {f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors": tensors for i, tensors in enumerate(shards)}


class _Pipeline:
    """Run band jobs on worker threads; hand their results to callbacks in submission order."""

    def __init__(self, pool: ThreadPoolExecutor, depth: int) -> None:
        self._pool = pool
        self._depth = depth
        self._pending: deque[tuple[Future[Any], Callable[[Any], None]]] = deque()

    def submit(self, job: Callable[[], Any], then: Callable[[Any], None]) -> None:
        self._pending.append((self._pool.submit(job), then))
        while len(self._pending) > self._depth:
            self._finish_one()

    def _finish_one(self) -> None:
        future, then = self._pending.popleft()
        then(future.result())

    def drain(self) -> None:
        while self._pending:
            self._finish_one()


@contextmanager
def _single_threaded_torch() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextmanager
def band_workers(workers: int | None = None) -> Iterator[ThreadPoolExecutor]:
    """The threads bands are encoded on, torch single-threaded inside each (as ``rewrite_component`` runs them):
    a band's sums reduce the same way whatever the machine's thread count."""
    with (
        _single_threaded_torch(),
        ThreadPoolExecutor(workers or len(os.sched_getaffinity(0)), thread_name_prefix="ditq-band") as pool,
    ):
        yield pool


def _rows_per_band(entry: TensorEntry, band_bytes: int) -> int:
    row_bytes = entry.nbytes // entry.shape[0] if entry.shape and entry.shape[0] else entry.nbytes
    return max(1, band_bytes // max(1, row_bytes))


def _relative_l2(error_sq: float, reference_sq: float) -> float:
    """A weight's relative L2 error from its bands' squared sums, added in float64 in band order."""
    return (error_sq / reference_sq) ** 0.5 if reference_sq > 0 else 0.0


@dataclass(frozen=True)
class StoredLayer:
    """One Linear quantized in memory (``ditq.quantize_``): its codec's stored tensors and its relative L2 error,
    computed band by band exactly as the streamer computes them from the source file; a GPTQ-rounded one also
    says how many of its calibration input rows held a NaN or an infinity and were left out of its Hessian."""

    # local name -> stored tensor, in file order (the codec's, then any low-rank branch's)
    tensors: dict[str, torch.Tensor]
    rel_l2: float
    rows_left_out: int = 0  # calibration input rows left out of the Hessian (GPTQ only)
    rows: int = 0  # every calibration input row the layer was given, those left out included (GPTQ only)


def encode_weight(
    weight: torch.Tensor,
    scheme: Scheme,
    device: torch.device,
    band_bytes: int,
    pool: ThreadPoolExecutor,
    low_rank: int = 0,
) -> StoredLayer:
    """A whole (out, in) weight quantized as ``rewrite_component`` quantizes it from a file of the weight's dtype:
    the same bands of rows (``band_bytes`` of source bytes each), encoded on ``pool`` (``band_workers``), their
    errors summed in the same order; with ``low_rank`` (a 4-bit ``scheme``: ``branch_rank``), the residual of its
    branch encoded so. The stored tensors
    come back on the CPU."""
    entry_bytes = weight.element_size() * weight.shape[1]
    rows = max(1, band_bytes // max(1, entry_bytes))
    rank = branch_rank(scheme, low_rank)
    split = split_low_rank(weight.to(device), rank) if rank else None
    values = weight if split is None else split.residual
    bands = [
        (values[i : i + rows], None if split is None else weight[i : i + rows])
        for i in range(0, weight.shape[0], rows)
    ]
    encoded = list(pool.map(lambda band: _encode_on(band[0], band[1], device, scheme), bands))
    codec = codec_for(scheme)
    tensors = {
        codec.weight_name: torch.cat([band.stored_rows for band in encoded]),
        SCALE: torch.cat([band.scale for band in encoded]),
        **codec.trailer(*weight.shape),
        **({} if split is None else {n: t.cpu() for n, t in split.tensors().items()}),
    }
    error_sq = reference_sq = 0.0
    for band in encoded:
        error_sq += band.error_sq
        reference_sq += band.reference_sq
    return StoredLayer(tensors, _relative_l2(error_sq, reference_sq))


@dataclass
class EncodedBand:
    """One band of rows: the stored weight rows, their scales, and the squared error terms of the band."""

    stored_rows: torch.Tensor  # the format's weight rows: (rows, in) int8/fp8, or (rows, in/4) int32
    scale: torch.Tensor  # (rows, groups) float32
    error_sq: float  # sum (w - dequantized)^2 over the band
    reference_sq: float  # sum w^2 over the band


def encode_band(
    weight_rows: torch.Tensor, scheme: Scheme, reference_rows: torch.Tensor | None = None
) -> EncodedBand:
    """Quantize a (rows, in) band of a weight; stored rows and scales come back on the CPU.

    Quantization is per output row (channel, or groups within a row), so bands encode like the whole tensor.
    ``reference_rows``: the weight's own rows where ``weight_rows`` is a low-rank branch's residual (its error is
    the layer's; its norm is not).
    """
    q, scale = quantize_weight(weight_rows, scheme)
    values = weight_rows.to(torch.float32)
    reference = values if reference_rows is None else reference_rows.to(torch.float32)
    error = dequantize_weight(q, scale).sub_(values)
    # float32 sums over one band (torch reduces in blocks); bands are summed in float64 by the caller.
    error_sq = float(torch.linalg.vector_norm(error)) ** 2
    reference_sq = float(torch.linalg.vector_norm(reference)) ** 2
    stored = codec_for(scheme).encode_values(q)
    return EncodedBand(stored.cpu(), scale.cpu(), error_sq, reference_sq)


def _encode_on(
    band: torch.Tensor, weight_band: torch.Tensor | None, device: torch.device, scheme: Scheme
) -> EncodedBand:
    """``band`` encoded on ``device``; ``weight_band``: the weight's rows where ``band`` is a residual's."""
    reference = None if weight_band is None else weight_band.to(device)
    return encode_band(band.to(device), scheme, reference)


def _check_finite(band: torch.Tensor, where: str) -> torch.Tensor:
    if band.is_floating_point() and not torch.isfinite(band).all():
        raise InputError(f"{where} holds NaN or Inf")
    return band.view(torch.uint8)


class _Streamer:
    """Streams one component's source files into the writer (see the module docstring)."""

    def __init__(
        self,
        plan: TargetPlan,
        schemes: Mapping[str, Scheme],
        writer: ShardSetWriter,
        pipeline: _Pipeline,
        result: ComponentResult,
        device: torch.device,
        band_bytes: int,
        bar: tqdm,
        stored: Mapping[str, StoredLayer],
        low_rank: int,
    ) -> None:
        self.plan, self.schemes, self.writer, self.pipeline = plan, schemes, writer, pipeline
        self.result, self.device, self.band_bytes, self.bar = result, device, band_bytes, bar
        self.stored, self.low_rank = stored, low_rank

    def stream_file(self, header: SafetensorsHeader) -> None:
        with open_regular(header.path) as handle:
            position = header.data_start
            for entry in header.in_file_order():
                if entry.begin != position:
                    raise InputError(f"{header.path}: tensor {entry.name} does not follow the previous one")
                prefix = entry.name[: -len(".weight")]
                if entry.name.endswith(".weight") and prefix in self.stored:
                    self._from_memory(entry, prefix)
                elif entry.name.endswith(".weight") and prefix in self.plan.targets:
                    self._quantize(handle, entry, prefix)
                else:
                    self._copy(handle, entry)
                position = entry.end

    def _copy(self, handle, entry: TensorEntry) -> None:
        where = f"{handle.name}: tensor {entry.name}"
        for _, band in read_rows(handle, entry, _rows_per_band(entry, 4 * self.band_bytes)):
            self.pipeline.submit(partial(_check_finite, band, where), partial(self.writer.write, entry.name))
            self.bar.update(band.nbytes)
        self.result.kept_params += entry.nbytes // entry.dtype.itemsize

    def _from_memory(self, entry: TensorEntry, prefix: str) -> None:
        """A target quantized in memory: its stored tensors written as they are, in the order ``specs`` planned."""
        layer = self.stored[prefix]

        def take(_: None) -> None:
            for local, tensor in layer.tensors.items():
                self.writer.write(f"{prefix}.{local}", tensor)
            self.result.errors[prefix] = layer.rel_l2
            if layer.rows_left_out:
                self.result.calibration_rows_left_out[prefix] = (layer.rows_left_out, layer.rows)

        self.pipeline.submit(lambda: None, take)
        self.bar.update(entry.nbytes)
        self.result.quantized_tensors += 1
        self.result.quantized_params += entry.nbytes // entry.dtype.itemsize

    def _quantize(self, handle, entry: TensorEntry, prefix: str) -> None:
        scheme = self.schemes[prefix]
        codec = codec_for(scheme)
        scales: list[torch.Tensor] = []
        sums = [0.0, 0.0]  # squared error, squared reference

        def take(encoded: EncodedBand) -> None:
            if not torch.isfinite(encoded.scale).all():
                raise InputError(f"{handle.name}: tensor {entry.name} holds NaN or Inf")
            self.writer.write(f"{prefix}.{codec.weight_name}", encoded.stored_rows)
            scales.append(encoded.scale)
            sums[0] += encoded.error_sq
            sums[1] += encoded.reference_sq

        rows = _rows_per_band(entry, self.band_bytes)
        split = None
        bands: Iterable[
            tuple[torch.Tensor, torch.Tensor | None]
        ]  # (rows to encode, the weight's where they differ)
        # With a branch the SVD needs the whole weight: it is read at once, its residual encoded in the same bands.
        rank = branch_rank(scheme, self.low_rank)
        if rank:
            weight = next(read_rows(handle, entry, entry.shape[0]))[1]
            if not torch.isfinite(weight).all():
                raise InputError(f"{handle.name}: tensor {entry.name} holds NaN or Inf")
            split = split_low_rank(weight.to(self.device), rank)
            residual = split.residual
            bands = [(residual[i : i + rows], weight[i : i + rows]) for i in range(0, entry.shape[0], rows)]
        else:
            bands = ((band, None) for _, band in read_rows(handle, entry, rows))

        def finish(_: None) -> None:
            self.writer.write(f"{prefix}.{SCALE}", torch.cat(scales))
            for local, tensor in codec.trailer(*entry.shape).items():  # in the order ``specs`` planned
                self.writer.write(f"{prefix}.{local}", tensor)
            for local, tensor in ({} if split is None else split.tensors()).items():
                self.writer.write(f"{prefix}.{local}", tensor.cpu())
            self.result.errors[prefix] = _relative_l2(sums[0], sums[1])

        for band, weight_band in bands:
            self.pipeline.submit(partial(_encode_on, band, weight_band, self.device, scheme), take)
            self.bar.update(band.nbytes if weight_band is None else weight_band.nbytes)
        self.pipeline.submit(lambda: None, finish)
        self.result.quantized_tensors += 1
        self.result.quantized_params += entry.nbytes // entry.dtype.itemsize


def rewrite_component(
    src_dir: Path,
    out_dir: Path,
    plan: TargetPlan,
    schemes: Mapping[str, Scheme],
    device: torch.device,
    max_shard_bytes: int,
    band_bytes: int,
    workers: int | None = None,
    variant: str | None = None,
    stored: Mapping[str, StoredLayer] | None = None,
    low_rank: int = 0,
) -> ComponentResult:
    """Write the component's weights into ``out_dir`` (one file or shards, and their index); ``schemes`` gives
    each of ``plan.targets`` its scheme, ``low_rank`` the rank of the low-rank branch of every 4-bit target (0:
    none; ``branch_rank``).
    ``stored`` holds targets already quantized in memory (``ditq.save``): they are written as they are, every
    other target is quantized from the source, every other tensor copied."""
    entries = read_component_headers(src_dir, variant)
    _check_source(entries, plan)
    headers = sorted({h.path: h for h, _ in entries.values()}.values(), key=lambda h: h.path.name)
    groups = [_outputs(e.name, e, plan, schemes, low_rank) for h in headers for e in h.in_file_order()]
    stem = weight_stem(src_dir, variant)  # the output carries no variant: it is the quantized weights
    shards = _plan_shards(groups, stem, max_shard_bytes)
    result = ComponentResult(weight_files=sorted(shards))
    writer = ShardSetWriter(out_dir, shards)
    workers = workers or len(os.sched_getaffinity(0))
    source_bytes = sum(entry.nbytes for _, entry in entries.values())
    try:
        with (
            _single_threaded_torch(),
            ThreadPoolExecutor(workers, thread_name_prefix="ditq-band") as pool,
            progress_bar(source_bytes, f"quantize {plan.component}") as bar,
        ):
            pipeline = _Pipeline(pool, depth=2 * workers)
            streamer = _Streamer(
                plan, schemes, writer, pipeline, result, device, band_bytes, bar, stored or {}, low_rank
            )
            try:
                for header in headers:
                    streamer.stream_file(header)
                pipeline.drain()
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        result.written_files = writer.close()
    except BaseException:
        writer.abort()
        raise
    # The index is written for one file too: compressed-tensors' file-level tools look for an index or for
    # model.safetensors, and a diffusers component's single file is diffusion_pytorch_model.safetensors.
    if shards:
        weight_map = {t.name: file_name for file_name, tensors in shards.items() for t in tensors}
        total = sum(t.nbytes for tensors in shards.values() for t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        index_name = f"{stem}.safetensors.index.json"
        (out_dir / index_name).write_text(json.dumps(index, indent=2) + "\n")
        result.weight_files.append(index_name)
    return result
