"""Calibrated rounding in memory (``--calibrate gptq``): every target Linear's input Hessian gathered from the
model's own forward passes over calibration requests, then its weight rounded by GPTQ (``gptq.gptq_quantize``)
and stored exactly as its codec stores any weight.

Hessians are float32 (K, K), one per target; the targets are taken in groups whose Hessians fit
``Calibration.memory_bytes`` together, and the calibration requests run once per group (a model whose Hessians all
fit runs them once). Every layer sees the source model's own inputs: the layers before it are still in source
precision while it is calibrated (nothing is swapped until every layer is quantized), which is GPTQ without the
sequential re-run through already quantized layers.

A text encoder runs once per request, before the denoising loop: its passes send the requests for a few denoising
steps (``Calibration.run_before_steps``), which give its layers the rows every number of steps gives them.

With ``Calibration.resume`` every group's stored layers are kept on disk as soon as it is done, and a group kept
by an earlier run from the same inputs is taken back instead of calibrated again (``calibration_resume``).

With a low-rank branch (``ditq.quantization.low_rank``) GPTQ rounds the residual W - up @ down with the layer's own
Hessian: the branch runs in 16 bits on the same inputs, so the residual's output error is the layer's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ditq.checkpoint.codecs import codec_for
from ditq.checkpoint.low_rank import branch_rank
from ditq.errors import InputError
from ditq.numerics import dequantize_weight, relative_l2
from ditq.quantization.calibration_resume import CalibrationResume, group_inputs
from ditq.quantization.defaults import CALIBRATION_MEMORY
from ditq.quantization.gptq import gptq_quantize, hessian_hooks
from ditq.quantization.low_rank import split_low_rank
from ditq.quantization.rewrite import StoredLayer
from ditq.quantization.targets import linear_at
from ditq.schemes import Scheme

__all__ = ["Calibration", "calibrated_choices", "calibrated_layers", "hessian_groups"]

log = logging.getLogger(__name__)

HESSIAN_BYTES = 4  # float32
# the start of diffusers' names of the components that run before the denoising loop (text_encoder, _2, _3...)
TEXT_ENCODERS = "text_encoder"


@dataclass(frozen=True)
class Calibration:
    """How to calibrate: ``run`` sends the calibration requests through the model once (the hooks see every
    target's inputs); ``record`` is what the manifest keeps of them (the requests, their digest, seeds, steps)."""

    run: Callable[[], None]
    record: dict[str, Any] = field(default_factory=dict)
    # the requests at a few denoising steps: what a text encoder, which runs before the denoising loop, sees at any
    # number of steps (the same rows); its passes take this one. None: ``run``
    run_before_steps: Callable[[], None] | None = None
    # the Hessians summed on the host, each (K, K) product made where the inputs come and copied over (a streamed
    # source: the device keeps its memory for the activations); False: where the inputs come
    host: bool = False
    # where each layer is rounded, its weight and Hessian brought there one layer at a time (None: the Hessian's)
    device: torch.device | None = None
    memory_bytes: int = CALIBRATION_MEMORY  # the Hessians held at once
    damp: float = 0.01  # GPTQ's damping, a fraction of the Hessian's mean diagonal
    act_order: bool = True  # columns by decreasing Hessian diagonal, static group scales (gptq_quantize)
    resume: CalibrationResume | None = (
        None  # where finished groups are kept and taken back from (None: nowhere)
    )

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise InputError(f"--calibration-memory must be positive, got {self.memory_bytes}")
        if not 0 < self.damp < 1:
            raise InputError(f"calibration damp must be in (0, 1), got {self.damp}")

    def manifest(self) -> dict[str, Any]:
        """The manifest's ``options.calibration``: the method, the requests, the damping and the column order."""
        return {"method": "gptq", **self.record, "damp": self.damp, "act_order": self.act_order}


def hessian_groups(in_features: Mapping[str, int], memory_bytes: int) -> list[list[str]]:
    """The targets (name -> in_features), in order, cut into groups whose float32 Hessians fit ``memory_bytes``;
    a single target whose Hessian does not fit is an InputError naming it."""
    groups: list[list[str]] = []
    held = memory_bytes + 1  # start a group at the first target
    for name, k in in_features.items():
        size = k * k * HESSIAN_BYTES
        if size > memory_bytes:
            raise InputError(
                f"{name}: its input Hessian ({k} x {k}, {size / 2**30:.2f} GiB) exceeds --calibration-memory "
                f"({memory_bytes / 2**30:.2f} GiB)"
            )
        if held + size > memory_bytes:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += size
    return groups


def _encode(
    weight: torch.Tensor, hessian: torch.Tensor, scheme: Scheme, calibration: Calibration, low_rank: int
) -> StoredLayer:
    """One weight GPTQ-rounded with its Hessian, as its codec stores it (on the CPU), with its relative L2; with
    ``low_rank`` (a 4-bit ``scheme``: ``branch_rank``), its residual rounded so and its branch after the codec's
    tensors."""
    # rounded on the calibration's device, else where the Hessian was gathered (a streamed layer's weight waits on
    # the host; its inputs came on the device)
    at = calibration.device if calibration.device is not None else hessian.device
    reference = weight.detach().to(device=at, dtype=torch.float32)
    rank = branch_rank(scheme, low_rank)
    split = split_low_rank(reference, rank) if rank else None
    q, scale = gptq_quantize(
        reference if split is None else split.residual,
        hessian,
        bits=scheme.num_bits,
        group_size=scheme.group_size,
        damp=calibration.damp,
        act_order=calibration.act_order,
    )
    decoded = dequantize_weight(q, scale)
    branch = {} if split is None else split.tensors()
    if split is not None:
        decoded += split.up.to(torch.float32) @ split.down.to(torch.float32)
    error = relative_l2(decoded, reference)
    return StoredLayer({n: t.cpu() for n, t in (codec_for(scheme).encode(q, scale) | branch).items()}, error)


def calibrated_layers(
    module: torch.nn.Module,
    schemes: Mapping[str, Scheme],
    calibration: Calibration,
    low_rank: int = 0,
    component: str = "module",
) -> dict[str, StoredLayer]:
    """Target -> its GPTQ-rounded stored layer, for ``module``'s targets (prefix -> scheme: int weights only), with
    a branch of rank ``low_rank`` beside the 4-bit ones (0: none); ``module`` is not changed. A target the
    requests never reach is an InputError. ``component`` names ``module``'s groups in ``calibration.resume``."""
    floats = sorted(prefix for prefix, scheme in schemes.items() if scheme.weight_type != "int")
    if floats:
        raise InputError(
            f"--calibrate gptq rounds int weights (w4a16, w4a8, w8a16, w8a8); {floats[0]} is "
            f"{schemes[floats[0]].name}"
        )
    found = calibrated_choices(module, {p: [s] for p, s in schemes.items()}, calibration, low_rank, component)
    return {prefix: found[prefix][scheme.name] for prefix, scheme in schemes.items()}


def calibrated_choices(
    module: torch.nn.Module,
    choices: Mapping[str, Sequence[Scheme]],
    calibration: Calibration,
    low_rank: int = 0,
    component: str = "module",
) -> dict[str, dict[str, StoredLayer]]:
    """Target -> scheme name -> its GPTQ-rounded stored layer, for every int scheme among each target's
    ``choices`` (fp8 ones are left out: GPTQ here rounds to an int grid); each Hessian is gathered once and rounds
    every choice of its target (``ditq plan`` measures several). Hessians are held ``calibration.memory_bytes``
    at most at once (``hessian_groups``: one pass over the requests per group), the stored layers on the CPU; with
    ``calibration.resume``, each group is kept there under ``component`` once done, or taken back from there.
    ``module`` is not changed; a target the requests never reach is an InputError. A text encoder's passes
    (``component`` named so) take ``calibration.run_before_steps`` where there is one."""
    wanted = {p: [s for s in c if s.weight_type == "int"] for p, c in choices.items()}
    wanted = {p: c for p, c in wanted.items() if c}
    layers = {prefix: linear_at(module, prefix) for prefix in wanted}
    groups = hessian_groups({p: m.in_features for p, m in layers.items()}, calibration.memory_bytes)
    resume = calibration.resume
    inputs = group_inputs(module, wanted, groups, calibration.manifest(), low_rank) if resume else {}
    run = calibration.run
    if component.startswith(TEXT_ENCODERS) and calibration.run_before_steps is not None:
        run = calibration.run_before_steps
    stored: dict[str, dict[str, StoredLayer]] = {}
    for number, group in enumerate(groups, 1):
        here = {p: wanted[p] for p in group}
        if resume is not None and (kept := resume.load(component, number, inputs, here)) is not None:
            where = resume.path(component, number)
            log.info("calibration pass %d of %d: %d layers taken back from %s", number, len(groups), len(group),
                     where)  # fmt: skip
            stored |= kept
            continue
        log.info("calibration pass %d of %d: %d layers", number, len(groups), len(group))
        stored |= _calibrated_group(module, layers, here, calibration, low_rank, run)
        if resume is not None:
            resume.save(component, number, inputs, {p: stored[p] for p in group})
    return stored


def _calibrated_group(
    module: torch.nn.Module,
    layers: Mapping[str, torch.nn.Linear],
    group: Mapping[str, Sequence[Scheme]],
    calibration: Calibration,
    low_rank: int,
    run: Callable[[], None],
) -> dict[str, dict[str, StoredLayer]]:
    """One pass over the requests (``run``) gathering the Hessians of ``group``'s targets (prefix -> its schemes),
    then each target rounded in each of its schemes."""
    stored: dict[str, dict[str, StoredLayer]] = {}
    start = time.perf_counter()
    with hessian_hooks(module, group, "cpu" if calibration.host else None) as found:
        run()
    gathered = time.perf_counter()
    for prefix, schemes in group.items():
        if found[prefix].samples == 0:
            why = f"gave it no finite input ({found[prefix].dropped} rows with a NaN or an infinity)"
            raise InputError(
                f"{prefix}: the calibration requests {why if found[prefix].dropped else 'never ran this layer'}; "
                "it has no Hessian"
            )
        weight, hessian = layers[prefix].weight, found[prefix].hessian
        left_out, rows = found[prefix].dropped, found[prefix].dropped + found[prefix].samples
        stored[prefix] = {
            s.name: replace(
                _encode(weight, hessian, s, calibration, low_rank), rows_left_out=left_out, rows=rows
            )
            for s in schemes
        }
    log.info("calibration pass: Hessians gathered in %.1f s, %d layers rounded in %.1f s", gathered - start,
             len(group), time.perf_counter() - gathered)  # fmt: skip
    partial = {prefix: a for prefix, a in found.items() if a.dropped}
    if partial:
        worst, most = max(
            partial.items(), key=lambda item: item[1].dropped / (item[1].dropped + item[1].samples)
        )
        log.warning("calibration pass: %d layers had input rows with a NaN or an infinity, left out of their Hessians "
                    "(most: %s, %d of %d rows)", len(partial), worst, most.dropped,
                    most.dropped + most.samples)  # fmt: skip
    return stored
