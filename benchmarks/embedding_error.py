"""Per-row SQNR of a token embedding stored int8 per row against int4 (groups of 128, and per row), with the bytes
each costs at the full-size text encoder's table (Qwen3-VL-8B: 151936 x 4096): the numbers that chose how the 4-bit
schemes store the embedding (``ditq.schemes.W4A16.embedding``).

    python benchmarks/embedding_error.py --out benchmarks/results/h100-four-bit/embedding_error_cpu_COMMIT.json

Tables: a seeded random one (normal, rows of varied scale, as trained tables have: each row's standard deviation
drawn log-uniformly over a factor of 10), and the bundled demo model's text encoder's ``token_embedding`` (trained,
small). Each row is quantized as ditq quantizes a Linear's rows (``ditq.numerics.quantize_weight``: symmetric, round
to nearest) and its SQNR is 10 log10(||row||^2 / ||row - dequantized||^2), in dB (higher is better).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

FULL_SIZE = (151936, 4096)  # Qwen3-VL-8B-Instruct's vocabulary x hidden size
SEED = 0
RANDOM_ROWS = 8192
CHOICES = {
    "int8 per row": ("w8a16", None),
    "int4 groups of 128": ("w4a16", 128),
    "int4 per row": ("w4a16", None),
}


def row_sqnr_db(table: torch.Tensor, scheme_name: str, group_size: int | None) -> torch.Tensor:
    """(rows,) SQNR of each row of ``table`` stored in ``scheme_name`` with ``group_size``, in dB."""
    from ditq.numerics import dequantize_weight, quantize_weight
    from ditq.schemes import get_scheme

    scheme = get_scheme(scheme_name).with_group_size(group_size)
    table = table.to(torch.float32)
    restored = dequantize_weight(*quantize_weight(table, scheme), torch.float32)
    signal = table.square().sum(dim=1)
    noise = (table - restored).square().sum(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    return 10 * torch.log10(signal / noise)


def full_size_bytes(scheme_name: str, group_size: int | None) -> int:
    """The full-size table's stored bytes in ``scheme_name`` (``codec_for(scheme).specs``)."""
    from ditq.checkpoint.codecs import codec_for
    from ditq.schemes import get_scheme

    scheme = get_scheme(scheme_name).with_group_size(group_size)
    rows, dim = FULL_SIZE
    specs = codec_for(scheme).specs(rows, dim, group_size)
    return sum(
        torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        for dtype, shape in specs.values()
    )


def summary(sqnr: torch.Tensor) -> dict[str, float]:
    quantiles = torch.quantile(sqnr.double(), torch.tensor([0.0, 0.01, 0.5], dtype=torch.float64))
    return {
        "min_db": round(float(quantiles[0]), 2),
        "p01_db": round(float(quantiles[1]), 2),
        "median_db": round(float(quantiles[2]), 2),
        "mean_db": round(float(sqnr.double().mean()), 2),
    }


def tables() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(SEED)
    dim = FULL_SIZE[1]
    row_std = 10 ** (torch.rand(RANDOM_ROWS, 1, generator=generator) - 1.5)
    random = torch.randn(RANDOM_ROWS, dim, generator=generator) * row_std
    demo_file = (
        Path(__file__).resolve().parents[1]
        / "ditq/demo/model/text_encoder/diffusion_pytorch_model.safetensors"
    )
    demo = load_file(str(demo_file))["token_embedding.weight"]
    return {
        f"random normal {RANDOM_ROWS}x{dim} (seed {SEED})": random,
        f"demo token_embedding {list(demo.shape)}": demo,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    bf16 = FULL_SIZE[0] * FULL_SIZE[1] * 2
    results: dict[str, Any] = {"command": "python " + " ".join(sys.argv), "seed": SEED, "tables": {}}
    results["full_size_bytes"] = {"bf16": bf16} | {c: full_size_bytes(*how) for c, how in CHOICES.items()}
    for name, table in tables().items():
        results["tables"][name] = {c: summary(row_sqnr_db(table, *how)) for c, how in CHOICES.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for name, rows in results["tables"].items():
        for choice, numbers in rows.items():
            print(f"{name:45s} {choice:20s} {numbers} {results['full_size_bytes'][choice] / 1e9:.3f} GB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
