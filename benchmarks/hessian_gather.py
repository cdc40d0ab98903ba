"""What one GPTQ Hessian update costs at the full-size pipeline's widths, part by part, on CUDA.

    python benchmarks/hessian_gather.py --out benchmarks/results/h100-four-bit/hessian_gather_h100.json

Under ``--offload`` a calibration sums each Linear's (K, K) Hessian on the host: every forward call of every hooked
layer makes the product x^T x on the device, copies it over and adds it in. This times each part for bfloat16 inputs
of ``--rows`` rows (a 1024x1024 image is 4096 tokens; four references make 20480), median of ``--repeat`` (the device
synchronized): the product cast to float32 first (the path before ``out_dtype``) and made from bfloat16 straight
into float32 (``out_dtype``: exact products, tensor cores), with their largest relative difference; the copy to
pinned host memory; the host's running average (scale, then add: the reference GPTQ's update) against a plain add;
and ``HessianAccumulator.add`` whole, into a host sum and into one on the device.

The accumulator leaves out rows with a NaN or an infinity, and reads back how many per call: a synchronization of
the host with the device. That check is timed alone, and ``--calls`` adds in a row without a synchronization
between them, against the same products alone (what a device-held sum would cost without the check) and against
rows zeroed by ``torch.where`` and counted on the device (the alternative that never waits, for one copy of the
rows per call).
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


def one_width(k: int, rows: int, repeat: int, calls: int) -> dict[str, float]:
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

    # as HessianAccumulator.add reads it: one value a row, then its count on the host
    def finite_check() -> int:
        return int(torch.isfinite(x.sum(dim=1, dtype=torch.float32)).logical_not().sum())

    def products_alone() -> None:
        for _ in range(calls):
            torch.addmm(product, x.T, x, out_dtype=torch.float32, out=product)

    def accumulator_adds() -> None:
        for _ in range(calls):
            on_device.add(x)

    dropped = torch.zeros((), dtype=torch.int64, device="cuda")

    # never waits: non-finite rows zeroed (a copy of x) and counted on the device
    def masked_on_device() -> None:
        for _ in range(calls):
            finite = torch.isfinite(x.sum(dim=1, dtype=torch.float32))
            dropped.add_(finite.logical_not().sum())
            kept = torch.where(finite[:, None], x, 0)
            torch.addmm(product, kept.T, kept, out_dtype=torch.float32, out=product)

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
        "finite_check_read_back_ms": median_ms(finite_check, repeat),
        "calls": calls,
        "calls_products_alone_ms": median_ms(products_alone, repeat),
        "calls_accumulator_add_device_sum_ms": median_ms(accumulator_adds, repeat),
        "calls_masked_on_device_ms": median_ms(masked_on_device, repeat),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="4096,12288", help="comma list of K")
    parser.add_argument("--rows", default="4096,20480", help="comma list of input rows per call")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--calls", type=int, default=8, help="adds in a row, not synchronized between them")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = [
        one_width(int(k), int(rows), args.repeat, args.calls)
        for k in args.widths.split(",")
        for rows in args.rows.split(",")
    ]
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "host_threads": torch.get_num_threads(),
        "repeat": args.repeat,
        "calls": args.calls,
        "results": results,
    }
    atomic_write_json(args.out, report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
