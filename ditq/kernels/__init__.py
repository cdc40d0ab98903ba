"""Quantized matmul kernel paths, one module per path, all in one registry (see ``registry``).

Importing this package registers every path; a path whose device or library
is missing here still registers and reports why through ``supports``.
"""

from __future__ import annotations

from ditq.kernels import (
    fp8_scaled_mm,
    fp8_triton,
    reference,
    w4_triton,
    w8a8_int_mm,
    w8a8_triton,
    w8a16_triton,
)
from ditq.kernels.registry import (
    ENV_DISABLE,
    ENV_FORCE,
    KernelPath,
    Prepared,
    StoredWeight,
    all_kernels,
    candidate_paths,
    get_kernel,
    register_kernel,
    unregister_kernel,
)

__all__ = [
    "ENV_DISABLE",
    "ENV_FORCE",
    "KernelPath",
    "Prepared",
    "StoredWeight",
    "all_kernels",
    "candidate_paths",
    "fp8_scaled_mm",
    "fp8_triton",
    "get_kernel",
    "reference",
    "register_kernel",
    "unregister_kernel",
    "w4_triton",
    "w8a8_int_mm",
    "w8a8_triton",
    "w8a16_triton",
]
