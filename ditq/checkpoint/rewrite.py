"""Rewrite one component's weights: quantize its targets band by band, copy every other tensor byte for byte.

Memory: one band of rows (``band_bytes`` of source data, plus its float32
working copies) is resident at a time, whatever the tensor, shard or model
size. The source files are read once, front to back, and hashed on the way
(their sha256 feeds the manifest's tree digest without a second pass).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ditq.checkpoint.layout import weight_files
from ditq.checkpoint.safetensors_io import (
    OutputTensor,
    SafetensorsHeader,
    ShardSetWriter,
    TensorEntry,
    read_header,
    read_rows,
)
from ditq.checkpoint.stored import encode_band, stored_specs
from ditq.errors import InputError
from ditq.schemes import Scheme
from ditq.targets import TargetPlan

__all__ = ["ComponentResult", "read_component_headers", "rewrite_component", "weight_stem"]

SOURCE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_QUANTIZED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".input_scale")


@dataclass
class ComponentResult:
    weight_files: list[str] = field(default_factory=list)  # written, relative to the component folder
    quantized_tensors: int = 0
    quantized_params: int = 0
    kept_params: int = 0
    errors: dict[str, float] = field(default_factory=dict)  # target prefix -> relative L2 error
    source_files: dict[str, tuple[int, str]] = field(default_factory=dict)  # file name -> (size, sha256)


def read_component_headers(component_dir: Path) -> dict[str, tuple[SafetensorsHeader, TensorEntry]]:
    """Tensor name -> (its file's header, its entry), over every weight file of the component."""
    where: dict[str, tuple[SafetensorsHeader, TensorEntry]] = {}
    for path in weight_files(component_dir):
        header = read_header(path)
        for name, entry in header.entries.items():
            if name in where:
                raise InputError(f"{path}: tensor {name} also in {where[name][0].path.name}")
            where[name] = (header, entry)
    return where


def weight_stem(component_dir: Path) -> str:
    """The file-name stem the source uses (``diffusion_pytorch_model``, ``model``)."""
    first = weight_files(component_dir)[0].name
    return re.sub(r"(-\d{5}-of-\d{5})?\.safetensors$", "", first)


def _check_source(entries: dict[str, tuple[SafetensorsHeader, TensorEntry]], plan: TargetPlan) -> None:
    for name, (header, entry) in entries.items():
        if name.endswith(_QUANTIZED_SUFFIXES) or (
            name.endswith(".weight") and entry.dtype in (torch.int8, torch.float8_e4m3fn, torch.int32)
        ):
            raise InputError(
                f"{header.path}: tensor {name} is already quantized; ditq quantizes BF16/FP16/FP32 models"
            )
    for prefix in plan.targets:
        header, entry = entries[f"{prefix}.weight"]
        if entry.dtype not in SOURCE_DTYPES:
            raise InputError(f"{header.path}: tensor {prefix}.weight has unsupported dtype {entry.dtype}")


def _outputs(name: str, entry: TensorEntry, plan: TargetPlan, scheme: Scheme) -> list[OutputTensor]:
    prefix = name[: -len(".weight")]
    if name.endswith(".weight") and prefix in plan.targets:
        layer = plan.targets[prefix]
        specs = stored_specs(scheme, layer.out_features, layer.in_features)
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


def _rows_per_band(entry: TensorEntry, band_bytes: int) -> int:
    row_bytes = entry.nbytes // entry.shape[0] if entry.shape and entry.shape[0] else entry.nbytes
    return max(1, band_bytes // max(1, row_bytes))


def _quantize_tensor(handle, entry, prefix, scheme, writer, hasher, device, band_bytes) -> float:  # type: ignore[no-untyped-def]
    """Stream one target weight through the encoder; returns its relative L2 error."""
    stored_name = f"{prefix}.weight_packed" if scheme.format == "pack-quantized" else f"{prefix}.weight"
    scales: list[torch.Tensor] = []
    error_sq = reference_sq = 0.0
    written = 0
    for _, band in read_rows(handle, entry, _rows_per_band(entry, band_bytes)):
        hasher.update(band.view(torch.uint8).numpy())
        encoded = encode_band(band.to(device), scheme)
        if not torch.isfinite(encoded.scale).all():
            raise InputError(f"{handle.name}: tensor {entry.name} holds NaN or Inf")
        writer.write(stored_name, encoded.stored_rows, written)
        written += encoded.stored_rows.numel() * encoded.stored_rows.element_size()
        scales.append(encoded.scale)
        error_sq += encoded.error_sq
        reference_sq += encoded.reference_sq
    writer.write(f"{prefix}.weight_scale", torch.cat(scales))
    if scheme.format == "pack-quantized":
        writer.write(f"{prefix}.weight_shape", torch.tensor(list(entry.shape), dtype=torch.int64))
    return (error_sq / reference_sq) ** 0.5 if reference_sq > 0 else 0.0


def _copy_tensor(handle, entry, writer, hasher, band_bytes) -> None:  # type: ignore[no-untyped-def]
    written = 0
    for _, band in read_rows(handle, entry, _rows_per_band(entry, band_bytes)):
        raw = band.view(torch.uint8)
        hasher.update(raw.numpy())
        if band.is_floating_point() and not torch.isfinite(band).all():
            raise InputError(f"{handle.name}: tensor {entry.name} holds NaN or Inf")
        writer.write(entry.name, raw, written)
        written += raw.numel()


def rewrite_component(
    src_dir: Path,
    out_dir: Path,
    plan: TargetPlan,
    scheme: Scheme,
    device: torch.device,
    max_shard_bytes: int,
    band_bytes: int,
) -> ComponentResult:
    """Write the component's weights into ``out_dir`` (shards + index when more than one)."""
    entries = read_component_headers(src_dir)
    _check_source(entries, plan)
    groups = [_outputs(name, entries[name][1], plan, scheme) for name in sorted(entries)]
    shards = _plan_shards(groups, weight_stem(src_dir), max_shard_bytes)
    result = ComponentResult(weight_files=sorted(shards))
    writer = ShardSetWriter(out_dir, shards)
    try:
        for header in sorted({h.path: h for h, _ in entries.values()}.values(), key=lambda h: h.path.name):
            result.source_files[header.path.name] = _stream_file(
                header, plan, scheme, writer, result, device, band_bytes
            )
        writer.close()
    except BaseException:
        writer.abort()
        raise
    if len(shards) > 1:
        weight_map = {t.name: file_name for file_name, tensors in shards.items() for t in tensors}
        total = sum(t.nbytes for tensors in shards.values() for t in tensors)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        index_name = f"{weight_stem(src_dir)}.safetensors.index.json"
        (out_dir / index_name).write_text(json.dumps(index, indent=2) + "\n")
        result.weight_files.append(index_name)
    return result


def _stream_file(header, plan, scheme, writer, result, device, band_bytes) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """Process one source file front to back; returns its (size, sha256)."""
    hasher = hashlib.sha256()
    with open(header.path, "rb") as handle:
        hasher.update(handle.read(header.data_start))
        position = header.data_start
        for entry in header.in_file_order():
            if entry.begin != position:
                raise InputError(
                    f"{header.path}: tensor {entry.name} does not follow the previous one (corrupt file)"
                )
            prefix = entry.name[: -len(".weight")]
            if entry.name.endswith(".weight") and prefix in plan.targets:
                result.errors[prefix] = _quantize_tensor(
                    handle, entry, prefix, scheme, writer, hasher, device, band_bytes
                )
                result.quantized_tensors += 1
                result.quantized_params += entry.nbytes // entry.dtype.itemsize
            else:
                _copy_tensor(handle, entry, writer, hasher, band_bytes)
                result.kept_params += entry.nbytes // entry.dtype.itemsize
            position = entry.end
        handle.seek(position)
        while chunk := handle.read(1 << 20):
            hasher.update(chunk)
            position += len(chunk)
    return position, hasher.hexdigest()
