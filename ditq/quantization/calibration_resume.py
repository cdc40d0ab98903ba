"""Resuming a calibration (``ditq quantize --calibrate gptq``): every Hessian group's GPTQ-rounded layers are kept on
disk as soon as the group is done, so that the same command run again after a kill takes them back instead of
sending the calibration requests through the model for them again.

The folder is ``.ditq-resume-<OUT>`` beside the output ``OUT`` (``CalibrationResume.beside``), marked as ditq's by
its ``RESUME.json`` (``ditq.fsutil.CALIBRATION_RESUME``: ditq writes into no folder it did not make), and removed
once the artifact is written. Each group is one safetensors file, ``<component>.group-<n>.safetensors``, written
whole to a temporary and renamed. Its metadata holds what the group was made from (``inputs``: the format, the
libraries' versions, the source files' sizes and modification times, the component, its targets' shapes and
schemes, the low rank, the calibration record, the group layout, the weights' device and dtype), the layers' errors
and tensor order, and a digest of the tensors' bytes. A group file made from other inputs, or one that cannot be
read whole (truncated, corrupt, not a regular file), is ignored with a log line naming it, and its group is
calibrated again: a resumed run stores exactly the bytes an uninterrupted one stores.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from ditq.checkpoint.manifest import library_versions
from ditq.checkpoint.safetensors_io import read_header, read_tensor
from ditq.checkpoint.source_tree import scan_tree
from ditq.errors import InputError
from ditq.fsutil import (
    CALIBRATION_RESUME,
    atomic_write_bytes,
    atomic_write_json,
    check_output,
    open_regular,
    sweep_stale_temporaries,
)
from ditq.jsonfile import JsonRefused, loads
from ditq.quantization.rewrite import StoredLayer
from ditq.schemes import Scheme

__all__ = ["RESUME_FORMAT", "CalibrationResume", "group_inputs", "source_fingerprint"]

log = logging.getLogger(__name__)

# of a group file; another format is another input, so its files are ignored (2: each layer's calibration rows left
# out of its Hessian, and all its rows)
RESUME_FORMAT = 2
_MARKER = CALIBRATION_RESUME.markers[0]

Layers = dict[str, dict[str, StoredLayer]]  # target -> scheme name -> its stored layer


def source_fingerprint(source: Path) -> dict[str, list[int]]:
    """Every file of the model directory ``source`` (``scan_tree``'s, links inside it followed) -> [size,
    mtime_ns]: what the calibrated model was loaded from, as a sweep fingerprints the model its stages ran."""
    files = scan_tree(source).files
    return {rel: [os.stat(path).st_size, os.stat(path).st_mtime_ns] for rel, path in sorted(files.items())}


def group_inputs(
    module: torch.nn.Module,
    wanted: Mapping[str, Sequence[Scheme]],
    groups: Sequence[Sequence[str]],
    calibration: Mapping[str, Any],
    low_rank: int,
) -> dict[str, Any]:
    """What a component's calibrated layers are made from, besides its source files and name: the targets (prefix
    -> [out, in] and the schemes rounded), the low rank, the calibration record (``Calibration.manifest``), the
    group layout (from ``--calibration-memory``), the weights' device type and dtypes, the format and versions."""
    weights = {p: module.get_submodule(p).get_parameter("weight") for p in wanted}
    return {
        "format": RESUME_FORMAT,
        "versions": library_versions(),
        "targets": {
            p: {"shape": list(weights[p].shape), "schemes": [dataclasses.asdict(s) for s in wanted[p]]}
            for p in wanted
        },
        "low_rank": low_rank,
        "calibration": dict(calibration),
        "groups": [list(g) for g in groups],
        "device": sorted({w.device.type for w in weights.values()}),
        "dtypes": sorted({str(w.dtype) for w in weights.values()}),
    }


def _changed(before: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The inputs that differ, a nested record's by its own keys too (``calibration.seeds``)."""
    changed = []
    for key in sorted(set(before) | set(now)):
        old, new = before.get(key), now.get(key)
        if isinstance(old, dict) and isinstance(new, dict) and key != "source":
            changed += [f"{key}.{inner}" for inner in _changed(old, new)]
        elif old != new:
            changed.append(key)
    return changed


def _tensor_digest(layers: Layers) -> str:
    """sha256 over every stored tensor's bytes, in the layers' order."""
    digest = hashlib.sha256()
    for by_scheme in layers.values():
        for layer in by_scheme.values():
            for tensor in layer.tensors.values():
                digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


@dataclass(frozen=True)
class CalibrationResume:
    """The folder a calibration keeps its finished groups in, and the source files' fingerprint
    (``source_fingerprint``) that every group's inputs carry."""

    folder: Path
    source: Mapping[str, list[int]]

    @classmethod
    def beside(cls, output: Path, source: Path) -> CalibrationResume:
        """The resume folder of ``output`` (``.ditq-resume-<name>`` beside it), held to ``check_output``: new,
        empty or one ditq made, apart from ``source``; the fingerprint taken of ``source`` now."""
        output = Path(output)
        folder = output.with_name(f".ditq-resume-{output.name}")
        check_output(folder, CALIBRATION_RESUME, [source], replace=False)
        return cls(folder, source_fingerprint(source))

    def path(self, component: str, number: int) -> Path:
        return self.folder / f"{component}.group-{number:04d}.safetensors"

    def held(self) -> list[Path]:
        """The group files the folder holds now."""
        return sorted(self.folder.glob("*.group-*.safetensors")) if self.folder.is_dir() else []

    def load(
        self, component: str, number: int, inputs: Mapping[str, Any], wanted: Mapping[str, Sequence[Scheme]]
    ) -> Layers | None:
        """Group ``number``'s layers as an earlier run kept them (target -> scheme name -> stored layer, every one
        ``wanted``), or None: none kept, or one made from other inputs or unreadable (ignored with a log line)."""
        path = self.path(component, number)
        if not os.path.lexists(path):
            return None
        inputs = json.loads(self._inputs(component, inputs))  # as JSON gives it back: lists, not tuples
        try:
            header = read_header(path)
            kept = loads(header.metadata.get("inputs", ""))
            if not isinstance(kept, dict):
                raise InputError(f"{path}: its inputs are not a record")
            if kept != inputs:
                log.warning(
                    "ignoring %s: made from other inputs (%s changed); calibrating its group again",
                    path,
                    ", ".join(_changed(kept, inputs)),
                )
                return None
            return _layers(path, header, wanted)
        except (InputError, JsonRefused, OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            log.warning("ignoring %s: not a whole group file (%s); calibrating its group again", path, error)
            return None

    def save(self, component: str, number: int, inputs: Mapping[str, Any], layers: Layers) -> None:
        """Keep group ``number``'s layers (written to a temporary, renamed into place), the folder made and
        marked first."""
        if not (self.folder / _MARKER).is_file():
            atomic_write_json(
                self.folder / _MARKER,
                {"what": "ditq quantize --calibrate gptq: its finished Hessian groups, removed once the artifact "
                 "is written; run the same command again to resume", "format": RESUME_FORMAT},
            )  # fmt: skip
        tensors = {
            f"{p}/{s}/{n}": t.detach().contiguous()
            for p, by_scheme in layers.items()
            for s, layer in by_scheme.items()
            for n, t in layer.tensors.items()
        }
        record = {
            p: {
                s: {
                    "rel_l2": layer.rel_l2,
                    "tensors": list(layer.tensors),
                    "rows_left_out": layer.rows_left_out,
                    "rows": layer.rows,
                }
                for s, layer in b.items()
            }
            for p, b in layers.items()
        }
        metadata = {
            "inputs": self._inputs(component, inputs),
            "layers": json.dumps(record),
            "sha256": _tensor_digest(layers),
        }
        path = self.path(component, number)
        sweep_stale_temporaries(path)  # a killed run's half-written one
        atomic_write_bytes(path, safetensors_bytes(tensors, metadata))

    def _inputs(self, component: str, inputs: Mapping[str, Any]) -> str:
        """A group's inputs as its file records them: ``group_inputs``', the source files' and the component."""
        return json.dumps({**inputs, "source": dict(self.source), "component": component}, sort_keys=True)

    def remove(self) -> None:
        """Remove the folder (the artifact is written); only one ditq marked as its own."""
        if (self.folder / _MARKER).is_file() and not self.folder.is_symlink():
            shutil.rmtree(self.folder)


def _layers(path: Path, header: Any, wanted: Mapping[str, Sequence[Scheme]]) -> Layers:
    """The layers a group file holds, checked against ``wanted`` and its digest; an InputError naming what is
    wrong otherwise."""
    record = loads(header.metadata.get("layers", ""))
    names = {p: sorted(s.name for s in schemes) for p, schemes in wanted.items()}
    if not isinstance(record, dict) or {p: sorted(b) for p, b in record.items()} != names:
        raise InputError(f"{path}: holds other layers than its group's")
    layers: Layers = {}
    with open_regular(path) as handle:
        for prefix, by_scheme in record.items():
            layers[prefix] = {}
            for scheme, entry in by_scheme.items():
                tensors = {
                    n: read_tensor(handle, header.entries[f"{prefix}/{scheme}/{n}"]) for n in entry["tensors"]
                }
                left_out, rows = entry["rows_left_out"], entry["rows"]
                if not all(type(n) is int for n in (left_out, rows)) or not 0 <= left_out <= rows:
                    raise InputError(f"{path}: {prefix}: its row counts are not 0 <= rows left out <= rows")
                layers[prefix][scheme] = StoredLayer(tensors, float(entry["rel_l2"]), left_out, rows)
    if _tensor_digest(layers) != header.metadata.get("sha256"):
        raise InputError(f"{path}: its tensors do not match their digest")
    return layers
