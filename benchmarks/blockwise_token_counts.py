"""Which token counts cuBLAS's 1x128 blockwise fp8 GEMM takes, as ``widen-scaled-mm-w4a8`` calls it through
``torch._scaled_mm`` (e4m3 x e4m3, a (M, K / 128) column-major activation scale, a (K / 128, N) weight scale):
each M of a range tried once at K = 4096, N = 1024, and the ones cuBLAS refuses (``CUBLAS_STATUS_NOT_SUPPORTED``)
listed. What the path's row padding (``ditq.kernels.w4_triton._w4a8_widened_gemm``) rests on. On a GPU:

    python benchmarks/blockwise_token_counts.py --out benchmarks/results/blockwise_token_counts_CARD_COMMIT.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from result_names import result_path

COUNTS = [*range(512, 545), 600, 4352, 4353, 20736, 20737]


def refused(k: int = 4096, n: int = 1024) -> tuple[list[int], list[int]]:
    """(the counts tried, those cuBLAS refused)."""
    weight = torch.randint(-8, 8, (n, k), device="cuda").to(torch.float8_e4m3fn)
    scale_b = torch.ones(k // 128, n, device="cuda")
    out = []
    for m in COUNTS:
        x = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        scale_a = torch.ones(k // 128, m, device="cuda").t()
        try:
            torch._scaled_mm(x, weight.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
            torch.cuda.synchronize()
        except RuntimeError:
            out.append(m)
    return COUNTS, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="the JSON to write (default: results/ by card)"
    )
    args = parser.parse_args()
    tried, bad = refused()
    record = {
        "command": "python benchmarks/blockwise_token_counts.py",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "tried": tried,
        "refused": bad,
        "every_refused_count_is_not_a_multiple_of_4": all(m % 4 for m in bad),
    }
    out = args.out or result_path("blockwise_token_counts")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"blockwise fails at M = {bad}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
