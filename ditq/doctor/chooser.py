"""The one kernel-choice policy, applied at load time: for each geometry, the first candidate path (registry
order, DITQ_KERNELS / DITQ_DISABLE_KERNELS honoured) that passes the doctor's fast subset, chosen before the
repack so a refused path can still be replaced. The chooser records what it chose and what it refused."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ditq.doctor.cases import Geometry
from ditq.doctor.run import check_paths
from ditq.errors import DitqError
from ditq.kernels.registry import KernelPath, candidate_paths
from ditq.schemes import Scheme

__all__ = ["STARTUP_ROWS", "KernelChoice", "VerifiedChooser", "choose_kernel", "kernel_chooser"]

log = logging.getLogger(__name__)

STARTUP_ROWS = 256  # M: tokens per check of the fast subset


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
    accumulate: str = "exact",
) -> KernelChoice:
    """The one kernel-choice policy: the first candidate path (registry order, DITQ_KERNELS /
    DITQ_DISABLE_KERNELS honoured) that passes the doctor's fast subset on this device.

    Fast subset: synthetic + analytic weights at this geometry, activations in ``dtype``, ``rows``
    tokens; verdicts cached per (device, driver, library versions, path, geometry). A failing
    path is refused with a warning naming its report directory, and the next candidate is tried;
    when none passes, DitqError names every report. Callers that accept --skip-doctor skip this
    call and log that as a warning themselves (``ditq.pipeline.open``). ``accumulate`` "fast" offers the
    fast-accumulating paths too, ahead of the exact ones (``ditq.kernels.registry.candidate_paths``).
    """
    device = torch.device(device)
    geometry = Geometry(in_features, out_features, group_size=group_size)
    refused: list[tuple[str, str | None]] = []
    for path in candidate_paths(scheme, device, dtype, in_features, out_features, accumulate):
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

    def __init__(self, accumulate: str = "exact") -> None:
        self.seconds = 0.0
        self.choices: list[KernelChoice] = []
        self.accumulate = accumulate

    def __call__(self, layer: Any, device: torch.device, dtype: torch.dtype) -> KernelPath:
        started = time.perf_counter()
        try:
            choice = choose_kernel(layer.scheme, device, dtype, layer.in_features, layer.out_features,
                                   group_size=layer.group_size, accumulate=self.accumulate)  # fmt: skip
        finally:
            self.seconds += time.perf_counter() - started
        self.choices.append(choice)
        return choice.path

    def summary(self, layers: int) -> str:
        """One line for a server's /health: ``layers`` quantized layers, the geometries, the paths chosen
        and those refused on the way."""
        names = sorted({c.path.name for c in self.choices})
        line = f"{layers} quantized layers, {len(self.choices)} geometries, verified paths: {', '.join(names) or 'none'}"
        line += "; accumulation: fast where verified" if self.accumulate == "fast" else ""
        refused = sorted({name for c in self.choices for name in c.refused})
        return line + (f"; refused: {', '.join(refused)}" if refused else "")


def kernel_chooser(accumulate: str = "exact") -> VerifiedChooser:
    """The doctor's choice of each quantized layer's kernel path, for the opener to install
    (``ditq.pipeline.open.open_pipeline``) and the benchmarks alike: the doctor-verified path, chosen before the
    repack so a refused path can still be replaced. ``accumulate`` "fast" lets the doctor choose fast-accumulating
    paths where they pass; it needs the doctor, whose measurement is its only licence (so ``LoadOptions`` refuses it
    beside ``skip_doctor``)."""
    return VerifiedChooser(accumulate)
