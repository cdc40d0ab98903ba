"""What one GPTQ Hessian update costs at the full-size pipeline's widths, part by part, on CUDA.

    python benchmarks/hessian_gather.py --out benchmarks/results/h100-four-bit/hessian_gather_h100.json

Under ``--offload`` a calibration sums each Linear's (K, K) Hessian on the host: every forward call of every hooked
layer makes the product x^T x on the device, copies it over and adds it in. This times each part for bfloat16 inputs
of ``--rows`` rows (a 1024x1024 image is 4096 tokens; four references make 20480), median of ``--repeat`` (the device
synchronized): the product cast to float32 first (the path before ``out_dtype``) and made from bfloat16 straight
into float32 (``out_dtype``: exact products, tensor cores), with their largest relative difference; the copy to
pinned host memory; the host's running average (scale, then add: the reference GPTQ's update) against a plain add;
and ``HessianAccumulator.add`` whole, into a host sum and into one on the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ditq from this checkout, installed or not

from ditq.fsutil import atomic_write_json
from ditq.quantization.gptq import PRODUCT_ROWS, HessianAccumulator


def median_ms(call: Callable[[], object], repeat: int) -> float:
    call()  # the first call allocates (the pinned buffer, cuBLAS's workspace)
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def one_width(k: int, rows: int, repeat: int) -> dict[str, float]:
    gen = torch.Generator(device="cuda").manual_seed(k + rows)
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    product = torch.zeros(k, k, device="cuda")

    def cast_first() -> None:
        product.zero_()
        for chunk in x.split(PRODUCT_ROWS):
            cast = chunk.float()
            product.addmm_(cast.T, cast)

    def out_dtype() -> None:
        product.zero_()
        for chunk in x.split(PRODUCT_ROWS):
            torch.addmm(product, chunk.T, chunk, out_dtype=torch.float32, out=product)

    cast_first()
    reference = product.clone()
    out_dtype()
    difference = float(((product - reference).abs().max() / reference.abs().max()).item())
    pinned = torch.empty(k, k, pin_memory=True)
    host = torch.zeros(k, k)
    staged = torch.randn(k, k)

    def scale_then_add() -> None:
        host.mul_(0.999)
        host.add_(staged)

    on_host, on_device = HessianAccumulator(k, device="cpu"), HessianAccumulator(k, device="cuda")
    return {
        "k": k,
        "rows": rows,
        "product_cast_first_ms": median_ms(cast_first, repeat),
        "product_out_dtype_ms": median_ms(out_dtype, repeat),
        "product_max_relative_difference": difference,
        "copy_to_pinned_ms": median_ms(lambda: pinned.copy_(product), repeat),
        "host_scale_then_add_ms": median_ms(scale_then_add, repeat),
        "host_add_ms": median_ms(lambda: host.add_(staged), repeat),
        "accumulator_add_host_sum_ms": median_ms(lambda: on_host.add(x), repeat),
        "accumulator_add_device_sum_ms": median_ms(lambda: on_device.add(x), repeat),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="4096,12288", help="comma list of K")
    parser.add_argument("--rows", default="4096,20480", help="comma list of input rows per call")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = [
        one_width(int(k), int(rows), args.repeat)
        for k in args.widths.split(",")
        for rows in args.rows.split(",")
    ]
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "host_threads": torch.get_num_threads(),
        "repeat": args.repeat,
        "results": results,
    }
    atomic_write_json(args.out, report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
