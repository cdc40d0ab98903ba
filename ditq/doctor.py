"""The kernel doctor: prove each kernel path on this device before trusting it.

For every path the registry offers here, for each geometry (Linear shape) and
each kind of weights, the chain from file to output is checked one step at a
time, each step on its own inputs so that one failure cannot hide or fake
another:

1. ``load``: the stored tensors, written to a safetensors file and read back
   through the production reader into the production module (and moved to the
   device), are bitwise-equal to what was written;
2. ``scales``: weight scales are finite as stored and after the path's repack;
3. ``finite``: the layer's output (bf16 and fp16 activations, M = 512) holds
   no NaN or inf;
4. ``output``: the output against a float32 reference from the dequantized
   weights (with the same per-token activation quantization for w8a8/fp8):
   relative L2 within ``REL_L2_BOUND``; for the analytic weights (q = qmax,
   scale = 1/qmax, all-ones input) every output equals ``in_features``.

A path passes when every check passes. A path that the device claims to
support (``KernelPath.supports``) and that fails is a capability over-claim.

The runtime's start-up subset is ``choose_kernel``, the one kernel-choice
policy, which the loader calls through ``VerifiedChooser`` for each geometry
before the repack: synthetic + analytic weights at the model's own geometries,
cached per (device, driver, library versions, path, geometry) under the user
cache directory (``DITQ_CACHE_DIR`` overrides). A failing path is refused with
a message naming its report directory, and the next passing candidate is used;
the chooser records what it chose. Skipping the check (``--skip-doctor``) is
the caller's decision and is logged there as a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import ditq
import ditq.kernels  # importing the package registers every kernel path
from ditq.checkpoint.codecs import SCALE, codec_for, detect_codec, quantized_layers
from ditq.errors import DitqError
from ditq.fsutil import atomic_directory, atomic_write_json
from ditq.kernels.reference import reference_float32
from ditq.kernels.registry import KernelPath, all_kernels, candidate_paths, get_kernel
from ditq.kernels.stored import analytic_stored
from ditq.numerics import quantize_weight, relative_l2
from ditq.schemes import Scheme

__all__ = [
    "REL_L2_BOUND",
    "SEED_GEOMETRIES",
    "Check",
    "Geometry",
    "KernelChoice",
    "PathResult",
    "VerifiedChooser",
    "WeightCase",
    "check_paths",
    "choose_kernel",
    "environment",
    "kernel_chooser",
    "write_reports",
]

log = logging.getLogger(__name__)

REL_L2_BOUND = 0.005
ROWS = 512  # M: tokens per check
STARTUP_ROWS = 256
CHECK_DTYPES = (torch.bfloat16, torch.float16)
STEPS = ("load", "scales", "finite", "output")


@dataclass(frozen=True)
class Geometry:
    """One Linear shape: in_features -> out_features."""

    in_features: int
    out_features: int
    label: str = ""
    group_size: int | None = None  # w8a16 grouped scales

    def __str__(self) -> str:
        name = f"{self.in_features}->{self.out_features}"
        if self.group_size:
            name += f" g{self.group_size}"
        return f"{name} ({self.label})" if self.label else name


# The seed's four layer kinds; fused QKV and column share a shape and are checked once.
SEED_GEOMETRIES = (
    Geometry(4096, 12288, "fused QKV / column"),
    Geometry(4096, 4096, "row"),
    Geometry(12288, 4096, "wide-in"),
)


@dataclass(frozen=True)
class WeightCase:
    """Weights for one check: a name ("synthetic", "analytic", "artifact:<layer>") and the stored tensors."""

    name: str
    stored: Mapping[str, torch.Tensor]
    bias: torch.Tensor | None = None
    # For an artifact's own tensors: the file each stored tensor is read from, and their name prefix.
    sources: Mapping[str, Path] | None = None
    prefix: str = ""

    @property
    def analytic(self) -> bool:
        return self.name == "analytic"


@dataclass
class Check:
    """The result of one step for one (geometry, weights, activation dtype)."""

    step: str
    geometry: str
    weights: str
    dtype: str
    passed: bool
    message: str
    value: float | None = None
    bound: float | None = None


@dataclass
class PathResult:
    """A path's verdict and every check behind it."""

    path: str
    scheme: str
    device: str
    verdict: str  # "PASS" | "FAIL" | "SKIP"
    reason: str = ""
    capability_overclaim: bool = False
    checks: list[Check] = field(default_factory=list)
    report_dir: str | None = None

    @property
    def worst_rel_l2(self) -> float | None:
        values = [c.value for c in self.checks if c.step == "output" and c.value is not None]
        return max(values) if values else None

    @property
    def first_failure(self) -> Check | None:
        return next((c for c in self.checks if not c.passed), None)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["worst_rel_l2"] = self.worst_rel_l2
        data["bound"] = REL_L2_BOUND
        return data


# ---------------------------------------------------------------- weights


def synthetic_case(scheme: Scheme, geometry: Geometry, seed: int = 0) -> WeightCase:
    """Random weights quantized by ditq's quantizer, plus a random bias (checkpoint-independent)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(geometry.out_features, geometry.in_features, generator=generator) * 0.02
    q, scale = quantize_weight(weight, scheme.with_group_size(geometry.group_size))
    bias = torch.randn(geometry.out_features, generator=generator) * 0.1
    return WeightCase("synthetic", codec_for(scheme).encode(q, scale), bias)


def analytic_case(scheme: Scheme, geometry: Geometry) -> WeightCase:
    """q = qmax, scale = 1/qmax everywhere; with an all-ones input every output equals in_features."""
    return WeightCase("analytic", analytic_stored(scheme, geometry.out_features, geometry.in_features))


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ---------------------------------------------------------------- the chain, one step at a time


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
):  # type: ignore[no-untyped-def]
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
    stored_scale = case.stored["weight_scale"]
    if not torch.isfinite(stored_scale).all():
        return False, "stored weight_scale holds non-finite values (the checkpoint, not the kernel)", None
    module = _module(path.scheme, case.stored, None, device)
    module.use_kernel(path)
    module.prepare(device)
    repacked = module.prepared_tensors()["weight_scale"]
    bad = int((~torch.isfinite(repacked)).sum())
    if bad:
        return False, f"weight_scale after the {path.name} repack holds {bad} non-finite values", None
    return True, f"weight_scale finite as stored and after the repack ({tuple(repacked.shape)})", None


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
        generator = torch.Generator().manual_seed(1234)
        x = torch.randn(rows, in_features, generator=generator).to(device=device, dtype=dtype)
    with torch.no_grad():
        out = module(x)
    q, scale = codec_for(path.scheme).read(case.stored)
    ref = reference_float32(
        x, q.to(device), scale.to(device), None if bias is None else bias.to(device), path.scheme.activations
    )
    return out, ref


def _output_checks(
    out: torch.Tensor, ref: torch.Tensor, case: WeightCase, in_features: int
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
    if case.analytic:
        deviation = float((out.to(torch.float64) - in_features).abs().max()) if bad == 0 else float("inf")
        message = (
            f"every output == {in_features}"
            if deviation == 0
            else f"max |out - {in_features}| = {deviation:g}"
        )
        return [finite, ("output", deviation == 0, message, deviation, 0.0)]
    error = relative_l2(out, ref) if bad == 0 else float("inf")
    ok = error <= REL_L2_BOUND
    message = f"rel-L2 {error:.2e} vs float32 reference ({'<=' if ok else '>'} {REL_L2_BOUND:g})"
    return [finite, ("output", ok, message, error, REL_L2_BOUND)]


def _raised(error: BaseException) -> str:
    return f"raised {type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


def check_path(
    path: KernelPath,
    geometries: Sequence[Geometry],
    cases: Callable[[Scheme, Geometry], list[WeightCase]],
    device: torch.device,
    rows: int = ROWS,
    dtypes: Sequence[torch.dtype] = CHECK_DTYPES,
) -> PathResult:
    """Every step for every (geometry, weights, activation dtype) this path supports here."""
    result = PathResult(path.name, path.scheme.name, str(device), "PASS")
    claimed = False
    for geometry in geometries:
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
                    ok, message, value = False, _raised(error), None
                result.checks.append(
                    Check(
                        step,
                        dtype="-",
                        passed=ok,
                        message=message,
                        value=value,
                        geometry=where,
                        weights=weights,
                    )
                )
            for dtype in supported:
                dtype_name = str(dtype).removeprefix("torch.")
                try:
                    out, ref = _layer_output(path, case, device, dtype, rows, geometry.in_features)
                    outcomes = _output_checks(out, ref, case, geometry.in_features)
                except Exception as error:
                    outcomes = [(step, False, _raised(error), None, None) for step in ("finite", "output")]
                for step, ok, message, value, bound in outcomes:
                    result.checks.append(
                        Check(
                            step,
                            dtype=dtype_name,
                            passed=ok,
                            message=message,
                            value=value,
                            bound=bound,
                            geometry=where,
                            weights=weights,
                        )
                    )
    if not claimed:
        reasons = {
            path.supports(device, d, g.in_features, g.out_features)[1] for g in geometries for d in dtypes
        }
        result.verdict, result.reason = "SKIP", "; ".join(sorted(reasons))
    elif result.first_failure is not None:
        failure = result.first_failure
        result.verdict = "FAIL"
        result.reason = (
            f"{failure.step}: {failure.message} [{failure.geometry}, {failure.weights}, {failure.dtype}]"
        )
        result.capability_overclaim = True  # supports() said yes on this device
    return result


def default_cases(weights: Sequence[str]) -> Callable[[Scheme, Geometry], list[WeightCase]]:
    """Weight cases by name: "synthetic" and/or "analytic"."""

    def cases(scheme: Scheme, geometry: Geometry) -> list[WeightCase]:
        out = []
        if "synthetic" in weights:
            out.append(synthetic_case(scheme, geometry))
        if "analytic" in weights:
            out.append(analytic_case(scheme, geometry))
        return out

    return cases


# ---------------------------------------------------------------- environment, cache, reports


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no NVIDIA driver or no NVML: recorded as unknown
        return None


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def environment(device: torch.device | str) -> dict[str, Any]:
    """What a report must say about where it ran."""
    device = torch.device(device)
    env: dict[str, Any] = {
        "device": str(device),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _package_version("triton"),
        "ditq": ditq.__version__,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                   driver=_driver_version())  # fmt: skip
    else:
        env.update(gpu=None, capability=None, driver=None, cpu=platform.processor() or platform.machine())
    return env


def cache_dir() -> Path:
    """Where verdicts are cached: $DITQ_CACHE_DIR, else the user cache directory."""
    override = os.environ.get("DITQ_CACHE_DIR")
    if override:
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ditq"


def _cache_key(
    env: Mapping[str, Any], path: KernelPath, geometries: Sequence[Geometry], settings: Mapping[str, Any]
) -> str:
    keyed = {k: env.get(k) for k in ("gpu", "capability", "driver", "cuda", "torch", "triton", "ditq", "cpu")}
    blob = json.dumps(
        [keyed, path.name, [str(g) for g in geometries], dict(settings)], sort_keys=True, default=str
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _from_json(data: Mapping[str, Any]) -> PathResult:
    checks = [Check(**c) for c in data["checks"]]
    fields = {
        k: data[k]
        for k in ("path", "scheme", "device", "verdict", "reason", "capability_overclaim", "report_dir")
    }
    return PathResult(checks=checks, **fields)


def repro_command(path_name: str) -> str:
    return f"ditq doctor --synthetic --kernels {path_name}"


def _chain_text(result: PathResult, env: Mapping[str, Any]) -> str:
    lines = [
        f"# Kernel path {result.path} ({result.scheme}) failed on {env.get('gpu') or result.device}",
        "",
        f"Verdict: {result.verdict} — {result.reason}",
        f"Capability over-claim: {'yes: the registry offered this path on this device' if result.capability_overclaim else 'no'}",
        f"Reproduce (needs no checkpoint): `{repro_command(result.path)}`",
        "",
        "## Isolation chain (each step checked on its own inputs)",
        "",
        "| step | geometry | weights | dtype | result | detail |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {c.step} | {c.geometry} | {c.weights} | {c.dtype} | {'pass' if c.passed else 'FAIL'} | {c.message} |"
              for c in result.checks]  # fmt: skip
    lines += ["", "## Environment", "", *[f"- {k}: {v}" for k, v in env.items()], ""]
    return "\n".join(lines)


def write_report(result: PathResult, env: Mapping[str, Any], root: Path) -> Path:
    """A directory ready to file upstream: environment, isolation chain, reproduction command, evidence."""
    final = Path(root) / result.path
    result.report_dir = str(final)
    with atomic_directory(final, force=True) as tmp:
        atomic_write_json(tmp / "environment.json", dict(env))
        atomic_write_json(tmp / "evidence.json", {"environment": dict(env), **result.to_json()})
        (tmp / "chain.md").write_text(_chain_text(result, env))
        (tmp / "repro.txt").write_text(repro_command(result.path) + "\n")
    return final


def write_reports(results: Iterable[PathResult], env: Mapping[str, Any], root: Path) -> list[Path]:
    return [write_report(r, env, root) for r in results if r.verdict == "FAIL"]


# ---------------------------------------------------------------- entry points


def check_paths(
    paths: Sequence[KernelPath],
    geometries: Sequence[Geometry],
    device: torch.device | str,
    weights: Sequence[str] = ("synthetic", "analytic"),
    rows: int = ROWS,
    dtypes: Sequence[torch.dtype] = CHECK_DTYPES,
    use_cache: bool = False,
    report_root: Path | None = None,
    cases: Callable[[Scheme, Geometry], list[WeightCase]] | None = None,
) -> list[PathResult]:
    """Check each path; with ``use_cache`` a verdict for the same (device, driver, versions, path,
    geometries, settings) is read from the cache instead of recomputed. Failing paths get a report
    under ``report_root`` (default: the cache directory's ``reports``)."""
    device = torch.device(device)
    env = environment(device)
    settings = {"weights": list(weights), "rows": rows, "dtypes": [str(d) for d in dtypes]}
    results = []
    for path in paths:
        entry = cache_dir() / "doctor" / f"{_cache_key(env, path, geometries, settings)}.json"
        if use_cache and cases is None and entry.is_file():
            results.append(_from_json(json.loads(entry.read_text())))
            continue
        started = time.perf_counter()
        result = check_path(path, geometries, cases or default_cases(weights), device, rows, dtypes)
        log.debug("doctor: %s %s in %.1fs", path.name, result.verdict, time.perf_counter() - started)
        if result.verdict == "FAIL":
            write_report(result, env, report_root or cache_dir() / "reports")
        if use_cache and cases is None:
            entry.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(entry, result.to_json())
        results.append(result)
    return results


@dataclass(frozen=True)
class KernelChoice:
    """The kernel policy's decision for one geometry: the path, and the candidates refused before it."""

    scheme: Scheme
    geometry: Geometry
    activation_dtype: torch.dtype
    path: KernelPath
    refused: tuple[str, ...] = ()  # path names, most preferred first


def choose_kernel(
    scheme: Scheme,
    device: torch.device | str,
    dtype: torch.dtype,
    in_features: int,
    out_features: int,
    group_size: int | None = None,
    rows: int = STARTUP_ROWS,
) -> KernelChoice:
    """The one kernel-choice policy: the first candidate path (registry order, DITQ_KERNELS /
    DITQ_DISABLE_KERNELS honoured) that passes the doctor's fast subset on this device.

    Fast subset: synthetic + analytic weights at this geometry, activations in ``dtype``, ``rows``
    tokens; verdicts cached per (device, driver, library versions, path, geometry). A failing
    path is refused with a warning naming its report directory, and the next candidate is tried;
    when none passes, DitqError names every report. Callers that accept --skip-doctor skip this
    call and log that as a warning themselves (``kernel_chooser``).
    """
    device = torch.device(device)
    geometry = Geometry(in_features, out_features, group_size=group_size)
    refused: list[tuple[str, str | None]] = []
    for path in candidate_paths(scheme, device, dtype, in_features, out_features):
        (result,) = check_paths([path], [geometry], device, rows=rows, dtypes=(dtype,), use_cache=True)
        if result.verdict == "PASS":
            if refused:
                log.warning("kernel doctor: using %s for %s %s after refusing %s", path.name, scheme.name, geometry,
                            ", ".join(name for name, _ in refused))  # fmt: skip
            return KernelChoice(scheme, geometry, dtype, path, tuple(name for name, _ in refused))
        log.warning(
            "kernel doctor: refusing kernel path %s (%s); report: %s; trying the next path",
            path.name, result.reason, result.report_dir,
        )  # fmt: skip
        refused.append((path.name, result.report_dir))
    reports = "; ".join(f"{name}: {where}" for name, where in refused) or "no candidate paths"
    raise DitqError(f"no kernel path for {scheme.name} {geometry} on {device} passed the doctor ({reports})")


class VerifiedChooser:
    """A ``ditq.runtime.loader.KernelChooser`` through ``choose_kernel``, called by the loader once per
    geometry before the repack. It records what it chose and the time it took: the checks compile (and
    autotune) kernels, which a server's start-up time shows apart from reading weights."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.choices: list[KernelChoice] = []

    def __call__(self, layer: Any, device: torch.device, dtype: torch.dtype) -> KernelPath:
        started = time.perf_counter()
        try:
            choice = choose_kernel(layer.scheme, device, dtype, layer.in_features, layer.out_features,
                                   group_size=layer.group_size)  # fmt: skip
        finally:
            self.seconds += time.perf_counter() - started
        self.choices.append(choice)
        return choice.path

    def summary(self, layers: int) -> str:
        """One line for a server's /health: ``layers`` quantized layers, the geometries, the paths chosen
        and those refused on the way."""
        names = sorted({c.path.name for c in self.choices})
        line = f"{layers} quantized layers, {len(self.choices)} geometries, verified paths: {', '.join(names) or 'none'}"
        refused = sorted({name for c in self.choices for name in c.refused})
        return line + (f"; refused: {', '.join(refused)}" if refused else "")


def kernel_chooser(skip_doctor: bool) -> VerifiedChooser | None:
    """The loader's chooser for ``ditq generate``, ``ditq serve`` and the benchmarks alike: the doctor-verified
    path, chosen before the repack so a refused path can still be replaced; None (the registry's first
    candidate, unverified, logged as a warning) with ``--skip-doctor``."""
    if skip_doctor:
        log.warning("--skip-doctor: kernel paths run without verification on this device")
        return None
    return VerifiedChooser()


def table(results: Sequence[PathResult]) -> str:
    """One line per path: verdict, worst rel-L2 against the bound, first failing step, over-claim."""
    head = f"{'path':<26} {'scheme':<6} {'verdict':<7} {'worst rel-L2':>12} {'bound':>6}  {'over-claim':<10} detail"
    lines = [head, "-" * len(head)]
    for r in results:
        worst = "-" if r.worst_rel_l2 is None else f"{r.worst_rel_l2:.2e}"
        checks = f"{sum(c.passed for c in r.checks)}/{len(r.checks)} checks"
        detail = r.reason if r.verdict != "PASS" else checks
        overclaim = "YES" if r.capability_overclaim else "-"
        lines.append(
            f"{r.path:<26} {r.scheme:<6} {r.verdict:<7} {worst:>12} {REL_L2_BOUND:>6g}  {overclaim:<10} {detail}"
        )
    return "\n".join(lines)


def select_paths(
    device: torch.device, schemes: Sequence[str] | None, kernels: Sequence[str] | None
) -> list[KernelPath]:
    """The paths to check: those named (any device type), else every path for this device type."""
    if kernels:
        chosen = [get_kernel(name) for name in kernels]
    else:
        chosen = [p for p in all_kernels() if p.device_type == device.type]
    return [p for p in chosen if not schemes or p.scheme.name in schemes]


def artifact_cases(artifact: Path) -> dict[str, dict[Geometry, WeightCase]]:
    """scheme -> distinct geometry -> the artifact's first layer of that shape, read with the safetensors
    library (independent of ditq's reader, which the load step then checks against it)."""
    from safetensors import safe_open

    from ditq.checkpoint.layout import (
        component_names,
        load_component_config,
        quantization_config_of,
        read_model_index,
        tensor_files,
    )

    found: dict[str, dict[Geometry, WeightCase]] = {}
    for component in component_names(read_model_index(artifact)):
        component_dir = artifact / component
        if not (component_dir / "config.json").is_file():
            continue
        if quantization_config_of(load_component_config(component_dir), component) is None:
            continue
        files = tensor_files(component_dir)
        for prefix, names in quantized_layers(files).items():
            tensors = {}
            for key in names:
                with safe_open(str(files[f"{prefix}.{key}"]), framework="pt") as handle:
                    tensors[key] = handle.get_tensor(f"{prefix}.{key}")
            dtypes = {f"{prefix}.{key}": t.dtype for key, t in tensors.items()}
            codec = detect_codec(prefix, dtypes, str(files[f"{prefix}.{SCALE}"]))
            stored = {key: tensors[key] for key in codec.names if key in tensors}
            q, scale = codec.read(stored)
            scheme_name = codec.scheme.name
            groups = scale.shape[1]
            geometry = Geometry(
                q.shape[1], q.shape[0], group_size=None if groups == 1 else q.shape[1] // groups
            )
            if geometry in found.setdefault(scheme_name, {}):
                continue
            bias = None
            if f"{prefix}.bias" in files:
                with safe_open(str(files[f"{prefix}.bias"]), framework="pt") as handle:
                    bias = handle.get_tensor(f"{prefix}.bias").to(torch.float32)
            sources = {key: files[f"{prefix}.{key}"] for key in stored}
            found[scheme_name][geometry] = WeightCase(
                f"artifact:{component}/{prefix}", stored, bias, sources, prefix
            )
    return found


def run_doctor(
    device: torch.device | str,
    artifact: Path | None = None,
    schemes: Sequence[str] | None = None,
    kernels: Sequence[str] | None = None,
    synthetic: bool = False,
    report_root: Path | None = None,
    geometries: Sequence[Geometry] = SEED_GEOMETRIES,
    rows: int = ROWS,
) -> list[PathResult]:
    """The `ditq doctor` run: the selected paths over the artifact's geometries (or ``geometries``)."""
    device = torch.device(device)
    from_artifact = artifact_cases(Path(artifact)) if artifact is not None else None
    weights = ["analytic"] + (["synthetic"] if synthetic or from_artifact is None else [])
    results = []
    for path in select_paths(device, schemes, kernels):
        if from_artifact is None:
            path_geometries: Sequence[Geometry] = geometries
            cases = default_cases(weights)
        else:
            own = from_artifact.get(path.scheme.name, {})
            path_geometries = list(own)

            def cases(
                scheme: Scheme, geometry: Geometry, own: dict[Geometry, WeightCase] = own
            ) -> list[WeightCase]:
                return [own[geometry], *default_cases(weights)(scheme, geometry)]

        if not path_geometries:
            results.append(
                PathResult(
                    path.name,
                    path.scheme.name,
                    str(device),
                    "SKIP",
                    f"the artifact has no {path.scheme.name} layers",
                )
            )
            continue
        results.extend(
            check_paths([path], path_geometries, device, rows=rows, report_root=report_root, cases=cases)
        )
    return results
