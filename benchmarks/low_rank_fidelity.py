"""SVDQuant's low-rank branch on the demo model: round to nearest, GPTQ and GPTQ + low-rank at 4 bits, per layer and
end to end, with intervals over seeds.

    python benchmarks/low_rank_fidelity.py --seeds 2301-2304 --out benchmarks/results/low_rank_fidelity_cpu_COMMIT.json

As ``four_bit_fidelity.py`` runs it (every fixture of the demo, 8 steps, on the CPU in float32, in process; the
unquantized model's images are the reference; GPTQ calibrated on the fixtures' requests at seeds 0 and 1, columns
by decreasing input energy), each row quantizes the transformer in memory (``ditq.quantize_``, ``low_rank=R``).
The demo's targets are (256, 256) and (768, 256) or (256, 768): R = 16 and 32 keep 6 % and 12.5 % of a square
layer's rank (at this small width the branch's bfloat16 bytes are 50 % and 100 % of the layer's int4 weight's; at a
width of 3072, R = 32 adds 8 %). Per row: mean PSNR and SSIM
over every image, the mean per seed with its bootstrap interval, the gain of a low-rank row over the same
rounding without the branch (paired seed by seed), and per layer two SQNRs (dB, higher is better): the weight's,
10 log10(|W|^2 / |W - W_q|^2), and the output's on the inputs the layer sees in the judged runs of the first seed,
10 log10(sum |x W^T|^2 / sum |x (W - W_q)^T|^2) (GPTQ trades the first for the second).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from four_bit_fidelity import (
    CALIBRATION_SEEDS,
    STEPS,
    _adapter,
    _images,
    demo_requests,
    fidelity_scores,
    paired_change,
    sqnr_db,
    write_result,
)
from result_names import result_path

SEEDS = "2301-2304"
ROWS = {  # name -> (scheme, calibrate, low-rank R or None)
    "w4a16": ("w4a16", "rtn", None),
    "w4a16-lr32": ("w4a16", "rtn", 32),
    "w4a16-gptq": ("w4a16", "gptq", None),
    "w4a16-gptq-lr16": ("w4a16", "gptq", 16),
    "w4a16-gptq-lr32": ("w4a16", "gptq", 32),
}


class _OutputError:
    """Per quantized layer, the squared output and output error against the source weight on the layer's own inputs
    (forward hooks; float64 sums)."""

    def __init__(self, transformer: torch.nn.Module, source: dict[str, torch.Tensor]) -> None:
        from ditq.runtime.modules import quantized_linears

        self.sums: dict[str, list[float]] = {}
        self.active = True
        self.handles = [
            layer.register_forward_hook(self._hook(prefix, source[prefix]))
            for prefix, layer in quantized_linears(transformer).items()
        ]

    def _hook(self, prefix: str, weight: torch.Tensor):  # type: ignore[no-untyped-def]
        def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            if not self.active:
                return
            x = inputs[0].to(torch.float32)
            bias = getattr(module, "bias", None)
            reference = torch.nn.functional.linear(
                x, weight, None if bias is None else bias.to(torch.float32)
            )
            sums = self.sums.setdefault(prefix, [0.0, 0.0])
            sums[0] += float(reference.double().square().sum())
            sums[1] += float((output.to(torch.float32) - reference).double().square().sum())

        return hook

    def sqnr_db(self) -> dict[str, float]:
        return {prefix: sqnr_db(signal, noise) for prefix, (signal, noise) in self.sums.items()}


def _summary(values: list[float]) -> dict[str, float]:
    return {"mean": round(float(np.mean(values)), 2), "min": round(float(np.min(values)), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default=SEEDS, help="the judged seeds (default %(default)s)")
    parser.add_argument("--out", type=Path, default=result_path("low_rank_fidelity", "cpu"))
    args = parser.parse_args()
    from ditq.probe.fixtures import parse_seeds
    from ditq.quantization.in_memory import RECORD

    seeds = tuple(parse_seeds(args.seeds))
    requests = demo_requests(seeds)
    fixtures = list(dict.fromkeys(fixture_id for fixture_id, _ in requests))  # in the fixtures file's order
    started = time.time()
    source = _adapter(None, "rtn")
    weights = {n: m.weight.detach().clone() for n, m in source.pipeline.transformer.named_modules()
               if isinstance(m, torch.nn.Linear)}  # fmt: skip
    reference = _images(source, requests)
    rows: dict[str, dict] = {}  # type: ignore[type-arg]
    per_seed: dict[str, dict[int, float]] = {}
    for name, (scheme, calibrate, low_rank) in ROWS.items():
        begun = time.time()
        adapter = _adapter(scheme, calibrate, low_rank)
        record = getattr(adapter.pipeline.transformer, RECORD)
        outputs = _OutputError(adapter.pipeline.transformer, weights)
        images = {}
        for key, request in requests.items():
            outputs.active = key[1] == seeds[0]
            images.update(_images(adapter, {key: request}))
        scores, per_seed[name] = fidelity_scores(images, reference, fixtures, seeds)
        weight_sqnr = {p: sqnr_db(1.0, e * e) for p, e in record.errors.items()}
        output_sqnr = outputs.sqnr_db()
        rows[name] = {
            "scheme": scheme,
            "calibrate": calibrate,
            "low_rank": low_rank,
            **scores,
            "weight_sqnr_db": _summary(list(weight_sqnr.values())),
            "output_sqnr_db": _summary(list(output_sqnr.values())),
            "per_layer": {
                p: {"weight_sqnr_db": weight_sqnr[p], "output_sqnr_db": output_sqnr[p]}
                for p in sorted(weight_sqnr)
            },
            "seconds": round(time.time() - begun, 1),
        }
        print(
            f"{name:<16} PSNR {rows[name]['psnr_db']:6.2f} dB {rows[name]['psnr_db_interval']}  "
            f"SQNR weight {rows[name]['weight_sqnr_db']} output {rows[name]['output_sqnr_db']}",
            flush=True,
        )
    for name, row in rows.items():
        if row["low_rank"] is not None:
            base = next(n for n, r in rows.items() if r["low_rank"] is None and r["scheme"] == row["scheme"]
                        and r["calibrate"] == row["calibrate"])  # fmt: skip
            row["gain_db"] = {"over": base, **paired_change(per_seed[name], per_seed[base])}
            print(f"{name}: {row['gain_db']}")
    write_result(
        "low_rank_fidelity.py",
        args,
        {
            "what": "demo model, transformer quantized in memory; PSNR/SSIM against the unquantized float32 run; "
            "per-layer weight and output SQNR (dB)",
            "steps": STEPS,
            "seeds": list(seeds),
            "calibration_seeds": list(CALIBRATION_SEEDS),
            "fixtures": list(fixtures),
            "rows": rows,
            "total_seconds": round(time.time() - started, 1),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
