"""The doctor's entry points: check paths (through the cache), select the paths to check, and the
``ditq doctor`` run over the seed's or an artifact's geometries."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from ditq.doctor.artifact import artifact_cases
from ditq.doctor.cache import cache_dir, cache_entry, environment, read_cached, write_cached
from ditq.doctor.cases import SEED_GEOMETRIES, CaseMaker, Geometry, WeightCase, default_cases
from ditq.doctor.checks import CHECK_DTYPES, CHECKS_VERSION, REL_L2_BOUND, ROWS, check_path
from ditq.doctor.report import write_report
from ditq.kernels.registry import KernelPath, all_kernels, get_kernel
from ditq.runfiles import DoctorPath
from ditq.schemes import Scheme

__all__ = ["check_paths", "run_doctor", "scheme_geometries", "select_paths"]

log = logging.getLogger(__name__)


def check_paths(
    paths: Sequence[KernelPath],
    geometries: Sequence[Geometry],
    device: torch.device | str,
    weights: Sequence[str] = ("synthetic", "analytic"),
    rows: int = ROWS,
    dtypes: Sequence[torch.dtype] = CHECK_DTYPES,
    use_cache: bool = False,
    report_root: Path | None = None,
    cases: CaseMaker | None = None,
    report_progress: bool = False,
) -> list[DoctorPath]:
    """Check each path; with ``use_cache`` a verdict for the same (device, driver, versions, path,
    geometries, settings) is read from the cache instead of recomputed. Failing paths get a report
    under ``report_root`` (default: the cache directory's ``reports``)."""
    device = torch.device(device)
    env = environment(device)
    settings = {
        "weights": list(weights),
        "rows": rows,
        "dtypes": [str(d) for d in dtypes],
        "checks": CHECKS_VERSION,
    }
    results = []
    for path in paths:
        entry = cache_entry(env, path, geometries, settings)
        if use_cache and cases is None and entry.is_file():
            results.append(read_cached(entry))
            continue
        started = time.perf_counter()
        result = check_path(path, geometries, cases or default_cases(weights), device, rows, dtypes)
        # a doctor run over many paths and geometries takes minutes (kernels compile): say each path as it ends
        log.log(
            logging.INFO if report_progress else logging.DEBUG,
            "doctor: %s %s over %d geometries in %.1f s",
            path.name,
            result.verdict,
            len(geometries),
            time.perf_counter() - started,
        )
        if result.verdict == "FAIL":
            result = write_report(result, env, report_root or cache_dir() / "reports")
        if use_cache and cases is None:
            write_cached(entry, result)
        results.append(result)
    return results


def select_paths(
    device: torch.device, schemes: Sequence[str] | None, kernels: Sequence[str] | None
) -> list[KernelPath]:
    """The paths to check: those named (any device type), else every path for this device type."""
    if kernels:
        chosen = [get_kernel(name) for name in kernels]
    else:
        chosen = [p for p in all_kernels() if p.device_type == device.type]
    return [p for p in chosen if not schemes or p.scheme.name in schemes]


def scheme_geometries(scheme: Scheme, geometries: Sequence[Geometry]) -> list[Geometry]:
    """The geometries a path of ``scheme`` is checked at without an artifact: each as given and, where the scheme
    groups its scales (the 4-bit schemes), also with the groups ``ditq quantize`` gives that layer."""
    out = list(geometries)
    for geometry in geometries:
        group_size = scheme.fitted(geometry.in_features).group_size if scheme.num_bits == 4 else None
        grouped = replace(geometry, group_size=group_size)
        if group_size is not None and geometry.group_size is None and grouped not in out:
            out.append(grouped)
    return out


def run_doctor(
    device: torch.device | str,
    artifact: Path | None = None,
    schemes: Sequence[str] | None = None,
    kernels: Sequence[str] | None = None,
    synthetic: bool = False,
    report_root: Path | None = None,
    geometries: Sequence[Geometry] = SEED_GEOMETRIES,
    rows: int = ROWS,
    dtypes: Sequence[torch.dtype] = CHECK_DTYPES,
) -> list[DoctorPath]:
    """The `ditq doctor` run: the selected paths over the artifact's geometries (or ``geometries``), at the
    activation dtypes of ``dtypes`` each path takes."""
    device = torch.device(device)
    from_artifact = artifact_cases(Path(artifact)) if artifact is not None else None
    weights = ["analytic"] + (["synthetic"] if synthetic or from_artifact is None else [])
    results = []
    selected = select_paths(device, schemes, kernels)
    log.info("doctor: %d kernel paths to check on %s", len(selected), device)
    for index, path in enumerate(selected, 1):
        if from_artifact is None:
            path_geometries: Sequence[Geometry] = scheme_geometries(path.scheme, geometries)
            cases = default_cases(weights)
        else:
            own = from_artifact.get(path.scheme.name, {})
            path_geometries = list(own)

            def cases(
                scheme: Scheme, geometry: Geometry, own: dict[Geometry, WeightCase] = own
            ) -> list[WeightCase]:
                return [own[geometry], *default_cases(weights)(scheme, geometry)]

        if not path_geometries:
            skipped = DoctorPath(path=path.name, scheme=path.scheme.name, device=str(device), verdict="SKIP",
                                 reason=f"the artifact has no {path.scheme.name} layers", capability_overclaim=False,
                                 checks=[], report_dir=None, worst_rel_l2=None, bound=REL_L2_BOUND)  # fmt: skip
            results.append(skipped)
            continue
        log.info(
            "doctor: path %d of %d, %s, over %d geometries",
            index,
            len(selected),
            path.name,
            len(path_geometries),
        )
        results.extend(
            check_paths(
                [path],
                path_geometries,
                device,
                rows=rows,
                dtypes=dtypes,
                report_root=report_root,
                cases=cases,
                report_progress=True,
            )
        )
    return results
