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
   scale = 1/qmax, all-ones input) every output equals ``in_features`` as the
   output dtype holds it (4304 in bfloat16: 4288 or 4320, its two neighbours).

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

import ditq.kernels  # noqa: F401 - importing the package registers every kernel path
from ditq.doctor.artifact import artifact_cases
from ditq.doctor.cache import cache_dir, environment
from ditq.doctor.cases import (
    SEED_GEOMETRIES,
    Geometry,
    WeightCase,
    analytic_case,
    default_cases,
    synthetic_case,
)
from ditq.doctor.checks import (
    CHECK_DTYPES,
    FAST_ANALYTIC_PER_TERM,
    FAST_FRACTION,
    REL_L2_BOUND,
    ROWS,
    STEPS,
    check_path,
    scheme_error,
)
from ditq.doctor.chooser import STARTUP_ROWS, KernelChoice, VerifiedChooser, choose_kernel, kernel_chooser
from ditq.doctor.report import repro_command, table, write_report
from ditq.doctor.run import check_paths, run_doctor, select_paths

__all__ = [
    "CHECK_DTYPES",
    "FAST_ANALYTIC_PER_TERM",
    "FAST_FRACTION",
    "REL_L2_BOUND",
    "ROWS",
    "SEED_GEOMETRIES",
    "STARTUP_ROWS",
    "STEPS",
    "Geometry",
    "KernelChoice",
    "VerifiedChooser",
    "WeightCase",
    "analytic_case",
    "artifact_cases",
    "cache_dir",
    "check_path",
    "check_paths",
    "choose_kernel",
    "default_cases",
    "environment",
    "kernel_chooser",
    "repro_command",
    "run_doctor",
    "scheme_error",
    "select_paths",
    "synthetic_case",
    "table",
    "write_report",
]
