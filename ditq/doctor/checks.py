"""The isolation chain: each step of one kernel path checked on its own inputs, and the verdict behind it.

Steps: ``load`` (stored bytes through the production reader and module), ``scales`` (finite as stored and
after the repack), ``finite`` (no NaN or inf in the output), ``output`` (against the float32 reference:
relative L2 within ``REL_L2_BOUND``; the analytic weights exactly ``in_features`` as the output dtype holds it).

A path that accumulates fast (``KernelPath.accumulate``: Hopper's fp8 fast accumulation) is bounded by evidence
instead: its relative L2 against the reference within ``FAST_FRACTION`` of the scheme's own quantization error at
that geometry (``scheme_error``: the reference's output against the unquantized layer's, on the synthetic case's
weights and inputs), so that it adds at most about 3 % to the error the scheme already makes (sqrt(1 + 1/16)); and on
the analytic weights (all-ones products, every partial sum positive: the worst case for a narrow accumulator) below
``in_features`` by at most ``FAST_ANALYTIC_PER_TERM`` x K of it, and never above it (but for the output dtype's
rounding): an accumulator that keeps fewer bits only drops low bits. Measured on an H100: 1.95 % low at K=4096 and
20.3 % low at K=12288 (the bound: 12.5 % and 37.5 %). A NaN, a collapse to zero, a wrong scale (2x high, or low by
more than the bound) still fail. The image-level verdict then decides whether it may serve.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch

from ditq.checkpoint.codecs import codec_for
from ditq.doctor.cases import CaseMaker, Geometry, WeightCase, synthetic_weights
from ditq.kernels.reference import reference_float32
from ditq.kernels.registry import KernelPath
from ditq.numerics import quantize_weight, relative_l2, representable_neighbours
from ditq.runfiles import DoctorCheck, DoctorPath
from ditq.schemes import Scheme

__all__ = [
    "CHECKS_VERSION",
    "CHECK_DTYPES",
    "FAST_ANALYTIC_PER_TERM",
    "FAST_FRACTION",
    "REL_L2_BOUND",
    "ROWS",
    "STEPS",
    "check_path",
    "raised",
    "scheme_error",
    "verdict",
]

# The checks' own revision, part of every cached verdict's key: a verdict the checks of another revision gave is
# not reused (2: the analytic case expects in_features as the output dtype holds it; 3: fast-accumulating paths are
# bounded by the scheme's own error).
CHECKS_VERSION = 3
REL_L2_BOUND = 0.005
FAST_FRACTION = 0.25
FAST_ANALYTIC_PER_TERM = 2**-15
ROWS = 512  # M: tokens per check
CHECK_DTYPES = (torch.bfloat16, torch.float16)
STEPS = ("load", "scales", "finite", "output")


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _production_read(case: WeightCase) -> dict[str, torch.Tensor]:
    """The stored tensors as the production reader reads them from a safetensors file."""
    from ditq.checkpoint.safetensors_io import read_entry, read_header

    if case.sources is not None:
        return {
            key: read_entry(read_header(file).entries[f"{case.prefix}.{key}"])
            for key, file in case.sources.items()
        }
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="ditq-doctor-") as tmp:
        file = Path(tmp) / "layer.safetensors"
        save_file({f"layer.{k}": v.contiguous() for k, v in case.stored.items()}, str(file))
        entries = read_header(file).entries
        return {key: read_entry(entries[f"layer.{key}"]) for key in case.stored}


def _module(
    scheme: Scheme, stored: Mapping[str, torch.Tensor], bias: torch.Tensor | None, device: torch.device
):
    from ditq.runtime.modules import linear_from_stored

    on_device = {k: v.to(device) for k, v in stored.items()}
    return linear_from_stored(on_device, scheme, None if bias is None else bias.to(device))


def _step_load(path: KernelPath, case: WeightCase, device: torch.device) -> tuple[bool, str, float | None]:
    loaded = _production_read(case)
    module = _module(path.scheme, loaded, None, device)
    got = {k: v.cpu() for k, v in module.stored_tensors().items()}
    differing = [k for k, v in case.stored.items() if k not in got or not _bitwise_equal(v.cpu(), got[k])]
    if differing:
        return False, f"loaded tensors differ from the stored bytes: {', '.join(sorted(differing))}", None
    return (
        True,
        f"{len(got)} stored tensors bitwise-equal after file -> reader -> module -> {device.type}",
        None,
    )


def _step_scales(path: KernelPath, case: WeightCase, device: torch.device) -> tuple[bool, str, float | None]:
    problem = codec_for(path.scheme).scale_problem(case.stored["weight_scale"])
    if problem is not None:
        return False, f"stored {problem} (the checkpoint, not the kernel)", None
    module = _module(path.scheme, case.stored, None, device)
    module.use_kernel(path)
    module.prepare(device)
    repacked = module.prepared_tensors()["weight_scale"]
    bad = int((~torch.isfinite(repacked)).sum())
    if bad:
        return False, f"weight_scale after the {path.name} repack holds {bad} non-finite values", None
    return True, f"weight_scale finite as stored and after the repack ({tuple(repacked.shape)})", None


def _synthetic_input(rows: int, in_features: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(rows, in_features, generator=generator)


def scheme_error(scheme: Scheme, geometry: Geometry, device: torch.device, rows: int = ROWS) -> float:
    """The scheme's own quantization error at ``geometry``: relative L2 of the float32 reference (quantized weights
    and activations, exact arithmetic) against the unquantized layer, on the synthetic case's weights and inputs."""
    weight, bias = synthetic_weights(geometry)
    q, scale = quantize_weight(weight, scheme.with_group_size(geometry.group_size))
    x = _synthetic_input(rows, geometry.in_features).to(device)
    exact = x @ weight.to(device).t() + bias.to(device)
    quantized = reference_float32(x, q.to(device), scale.to(device), bias.to(device), scheme.activations)
    return relative_l2(quantized, exact)


def _output_bound(path: KernelPath, geometry: Geometry, device: torch.device, rows: int) -> float:
    """The rel-L2 bound of ``path``'s output at ``geometry``: the rounding bound, or, for a fast-accumulating path,
    ``FAST_FRACTION`` of the scheme's own error where that is the larger."""
    if path.accumulate == "exact":
        return REL_L2_BOUND
    return max(REL_L2_BOUND, FAST_FRACTION * scheme_error(path.scheme, geometry, device, rows))


def _layer_output(
    path: KernelPath, case: WeightCase, device: torch.device, dtype: torch.dtype, rows: int, in_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the production layer's output, the float32 reference) for one activation dtype."""
    bias = None if case.bias is None else case.bias.to(dtype)
    module = _module(path.scheme, case.stored, bias, device)
    module.use_kernel(path)
    module.prepare(device, dtype)
    if case.analytic:
        x = torch.ones(rows, in_features, dtype=dtype, device=device)
    else:
        x = _synthetic_input(rows, in_features).to(device=device, dtype=dtype)
    with torch.no_grad():
        out = module(x)
    q, scale = codec_for(path.scheme).read(case.stored)
    ref = reference_float32(
        x, q.to(device), scale.to(device), None if bias is None else bias.to(device), path.scheme.activations
    )
    return out, ref


def _output_checks(
    out: torch.Tensor, ref: torch.Tensor, case: WeightCase, in_features: int, bound: float, accumulate: str
) -> list[tuple[str, bool, str, float | None, float | None]]:
    """(step, passed, message, value, bound) for the finite and output steps."""
    if out.shape != ref.shape:
        return [("finite", False, f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}", None, None),
                ("output", False, f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}", None, None)]  # fmt: skip
    bad = int((~torch.isfinite(out)).sum())
    finite = (
        "finite",
        bad == 0,
        f"{bad} of {out.numel()} outputs are NaN/inf" if bad else "all outputs finite",
        None,
        None,
    )
    if case.analytic and accumulate == "fast":
        return [finite, _analytic_fast_output(out, in_features, bad)]
    if case.analytic:
        return [finite, _analytic_output(out, in_features, bad)]
    error = relative_l2(out, ref) if bad == 0 else float("inf")
    ok = error <= bound
    why = "" if accumulate == "exact" else f", {FAST_FRACTION:g} of the scheme's own error"
    message = f"rel-L2 {error:.2e} vs float32 reference ({'<=' if ok else '>'} {bound:.3g}{why})"
    return [finite, ("output", ok, message, error, bound)]


def _analytic_fast_output(
    out: torch.Tensor, in_features: int, non_finite: int
) -> tuple[str, bool, str, float | None, float | None]:
    """The analytic answer ``in_features`` for a fast-accumulating path: every output at most ``in_features`` as the
    output dtype holds it (a narrower accumulator only drops bits), and below it by at most
    ``FAST_ANALYTIC_PER_TERM`` x K, relative; the check's value is the largest relative shortfall."""
    tolerance = FAST_ANALYTIC_PER_TERM * in_features
    high = representable_neighbours(float(in_features), out.dtype)[1]
    values = out.to(torch.float64)
    above = non_finite > 0 or bool((values > high).any())
    shortfall = float("inf") if non_finite else float((in_features - values).clamp_min(0).max()) / in_features
    ok = not above and shortfall <= tolerance
    message = (
        f"an output above {in_features}: not an accumulator dropping bits"
        if above and not non_finite
        else f"max ({in_features} - out) / {in_features} = {shortfall:.3g} ({'<=' if ok else '>'} {tolerance:.3g}, "
        f"K x 2**-15: fast accumulation)"
    )
    return "output", ok, message, shortfall, tolerance


def _analytic_output(
    out: torch.Tensor, in_features: int, non_finite: int
) -> tuple[str, bool, str, float | None, float | None]:
    """The analytic weights' exact answer is ``in_features``, as the output dtype holds it: the value itself where
    the dtype represents it, else either of its two neighbours (4304 in bfloat16: 4288 or 4320). The check's value
    is the largest distance of an output from the nearer neighbour; every correct path gives 0."""
    low, high = representable_neighbours(float(in_features), out.dtype)
    if non_finite:
        deviation = float("inf")
    else:
        values = out.to(torch.float64)
        deviation = float(torch.minimum((values - low).abs(), (values - high).abs()).max())
    held = (
        f"{in_features}"
        if low == high
        else f"{in_features} as {str(out.dtype).removeprefix('torch.')} holds it ({low:g} or {high:g})"
    )
    message = f"every output == {held}" if deviation == 0 else f"max |out - {held}| = {deviation:g}"
    return "output", deviation == 0, message, deviation, 0.0


def raised(error: BaseException) -> str:
    """A check's message for a step that raised: the error's type and first line."""
    return f"raised {type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


def verdict(
    checks: Sequence[DoctorCheck], skipped: str | None
) -> tuple[Literal["PASS", "FAIL", "SKIP"], str]:
    """A path's verdict and its reason: SKIP with ``skipped`` (why it claimed no case here) when given, else FAIL
    with the first failing check (step, message, where), else PASS."""
    if skipped is not None:
        return "SKIP", skipped
    failure = next((c for c in checks if not c.passed), None)
    if failure is None:
        return "PASS", ""
    return (
        "FAIL",
        f"{failure.step}: {failure.message} [{failure.geometry}, {failure.weights}, {failure.dtype}]",
    )


def check_path(
    path: KernelPath,
    geometries: Sequence[Geometry],
    cases: CaseMaker,
    device: torch.device,
    rows: int = ROWS,
    dtypes: Sequence[torch.dtype] = CHECK_DTYPES,
) -> DoctorPath:
    """Every step for every (geometry, weights, activation dtype) this path supports here."""
    checks: list[DoctorCheck] = []
    claimed = False
    bounds = [REL_L2_BOUND]
    for geometry in geometries:
        bound: float | None = None
        for case in cases(path.scheme, geometry):
            supported = [
                d for d in dtypes if path.supports(device, d, geometry.in_features, geometry.out_features)[0]
            ]
            if not supported:
                continue
            claimed = True
            where, weights = str(geometry), case.name
            for step, run in (("load", _step_load), ("scales", _step_scales)):
                try:
                    ok, message, value = run(path, case, device)
                except Exception as error:  # a step that raises has failed; the next step still runs
                    ok, message, value = False, raised(error), None
                checks.append(DoctorCheck(step=step, geometry=where, weights=weights, dtype="-", passed=ok,
                                          message=message, value=value, bound=None))  # fmt: skip
            # a path that runs other code from some token count at this shape: both sides
            counts = path.rows_checked(rows, geometry.in_features, geometry.out_features)
            for dtype, count in ((d, c) for d in supported for c in counts):
                dtype_name = str(dtype).removeprefix("torch.")
                at = where if len(counts) == 1 else f"{where} M={count}"
                try:
                    if bound is None:
                        bound = _output_bound(path, geometry, device, rows)
                        bounds.append(bound)
                    out, ref = _layer_output(path, case, device, dtype, count, geometry.in_features)
                    outcomes = _output_checks(out, ref, case, geometry.in_features, bound, path.accumulate)
                except Exception as error:
                    outcomes = [(step, False, raised(error), None, None) for step in ("finite", "output")]
                for step, ok, message, value, limit in outcomes:
                    checks.append(DoctorCheck(step=step, geometry=at, weights=weights, dtype=dtype_name,
                                              passed=ok, message=message, value=value, bound=limit))  # fmt: skip
    skipped = None
    if not claimed:
        reasons = {
            path.supports(device, d, g.in_features, g.out_features)[1] for g in geometries for d in dtypes
        }
        skipped = "; ".join(sorted(reasons))
    outcome, reason = verdict(checks, skipped)
    values = [c.value for c in checks if c.step == "output" and c.value is not None]
    return DoctorPath(
        path=path.name,
        scheme=path.scheme.name,
        device=str(device),
        verdict=outcome,
        reason=reason,
        capability_overclaim=outcome == "FAIL",  # supports() said yes on this device
        checks=checks,
        report_dir=None,
        worst_rel_l2=max(values) if values else None,
        bound=max(bounds),
    )
