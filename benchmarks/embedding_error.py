"""Per-row SQNR of a token embedding stored int8 per row against int4 (groups of 128, and per row), with the bytes
each costs at the full-size text encoder's table (Qwen3-VL-8B: 151936 x 4096): the numbers that chose how the 4-bit
schemes store the embedding (``ditq.schemes.W4A16.embedding``).

    python benchmarks/embedding_error.py --out benchmarks/results/h100-four-bit/embedding_error_cpu_COMMIT.json

Tables: a seeded random one (normal, rows of varied scale, as trained tables have: each row's standard deviation
drawn log-uniformly over a factor of 10), and the bundled demo model's text encoder's ``token_embedding`` (trained,
small). Each row is quantized as ditq quantizes a Linear's rows (``ditq.numerics.quantize_weight``: symmetric, round
to nearest) and its SQNR is 10 log10(||row||^2 / ||row - dequantized||^2), in dB (higher is better). Beside them,
the whole tiny Qwen3-VL text encoder's output error with the embedding in int8 rows, alone and with w4a16 Linears
(``encoder_error``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

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


def encoder_error() -> dict[str, float]:
    """Relative L2 of the last hidden state of the tiny Qwen3-VL text encoder (``tools/full_size_pipeline.py``'s
    ``tiny`` preset, random weights, seed 0) against its source, over 2 x 48 seeded token ids: the embedding alone in
    int8 rows, every target Linear in w4a16 with the embedding kept (``--ignore embed_tokens``), and both (w4a16)."""
    import tempfile

    import full_size_pipeline as fsp
    from transformers import Qwen3VLForConditionalGeneration

    import ditq
    from ditq.numerics import relative_l2
    from ditq.runtime.loader import load_component

    variants: dict[str, dict[str, Any]] = {
        "embedding alone, int8 rows": {"targets": ["embed_tokens"]},
        "w4a16 Linears, embedding in BF16": {"ignore": ["embed_tokens"]},
        "w4a16 (Linears and int8 embedding rows)": {},
    }
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "source"
        fsp.build(source, "tiny", seed=SEED)
        reference = Qwen3VLForConditionalGeneration.from_pretrained(
            str(source / "text_encoder"), dtype=torch.float32
        )
        vocabulary = reference.config.text_config.vocab_size
        ids = torch.randint(0, vocabulary, (2, 48), generator=torch.Generator().manual_seed(SEED))
        with torch.no_grad():
            expected = reference(input_ids=ids, output_hidden_states=True).hidden_states[-1]
            for index, (name, options) in enumerate(variants.items()):
                artifact = ditq.quantize(
                    source, Path(folder) / f"a{index}", "w4a16", components=["text_encoder"], **options
                )
                model = load_component(artifact.path, "text_encoder", device="cpu", dtype=torch.float32)
                hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
                out[name] = round(relative_l2(hidden, expected), 5)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    bf16 = FULL_SIZE[0] * FULL_SIZE[1] * 2
    results: dict[str, Any] = {"command": "python " + " ".join(sys.argv), "seed": SEED, "tables": {}}
    results["full_size_bytes"] = {"bf16": bf16} | {c: full_size_bytes(*how) for c, how in CHOICES.items()}
    for name, table in tables().items():
        results["tables"][name] = {c: summary(row_sqnr_db(table, *how)) for c, how in CHOICES.items()}
    results["tiny_text_encoder_rel_l2"] = encoder_error()  # lower is better
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for name, rows in results["tables"].items():
        for choice, numbers in rows.items():
            print(f"{name:45s} {choice:20s} {numbers} {results['full_size_bytes'][choice] / 1e9:.3f} GB")
    for name, error in results["tiny_text_encoder_rel_l2"].items():
        print(f"tiny Qwen3-VL text encoder, last hidden state rel-L2: {name}: {error}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
