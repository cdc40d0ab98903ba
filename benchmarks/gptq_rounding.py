"""How long GPTQ takes to round one Linear at the full-size pipeline's geometries on CUDA: the torch column loop
against the Triton sweep (``ditq.quantization.gptq_triton``), and whether their codes agree.

    python benchmarks/gptq_rounding.py --out benchmarks/results/h100-four-bit/gptq_rounding_h100.json

For each (N, K) weight (float32 on the device, seeded) and a Hessian made from 2K seeded correlated inputs, it times
``gptq_quantize`` whole (4 bits, group 128, act order, damp 0.01: ``Calibration``'s defaults) with each sweep, the
device synchronized, best of ``--repeat`` after one warm-up (Triton compiles there); and, with the Hessian's
inversion taken out, the sweep alone. It records the fraction of codes equal between the two and each one's relative
output error ||X (W - Wq)^T|| / ||X W^T|| on the inputs; and, to find where codes differ, the two sweeps'
codes on one inverse, and each whole rounding's codes against the same rounding run again.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ditq from this checkout, installed or not

from ditq.fsutil import atomic_write_json
from ditq.numerics import dequantize_weight
from ditq.quantization import gptq
from ditq.quantization.gptq_triton import sweep_columns

# (N, K): the full-size transformer's and text encoder's Linears (hidden 4096, MLP 12288, the 1024-wide
# projections), as benchmarks/kernels_bench.py's --shapes four-bit
SHAPES_NK = [(12288, 4096), (4096, 4096), (4096, 12288), (1024, 4096)]


def best_s(call: Callable[[], object], repeat: int) -> float:
    call()  # warm-up: Triton compiles, cuSOLVER and cuBLAS allocate
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def one_shape(n: int, k: int, repeat: int) -> dict[str, float | int]:
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    mix = torch.randn(k, k, device="cuda", generator=gen) / k**0.5
    x = torch.randn(2 * k, k, device="cuda", generator=gen) @ mix
    hessian = x.T @ x * (2.0 / x.shape[0])
    weight = torch.randn(n, k, device="cuda", generator=gen) * 0.02

    def whole(triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
        saved = gptq._triton_sweeps
        gptq._triton_sweeps = lambda w, block_size: triton and saved(w, block_size)
        try:
            return gptq.gptq_quantize(weight, hessian, bits=4, group_size=128, act_order=True)
        finally:
            gptq._triton_sweeps = saved

    # the sweep alone: the inputs _act_order hands it
    inputs = gptq._act_order_inputs(weight, hessian.double(), 7, 128, 0.01)
    h_inv, w_perm, s_perm = inputs.h_inv, inputs.weight, inputs.column_scale

    def output_error(q: torch.Tensor, s: torch.Tensor) -> float:
        return float(((x @ (weight - dequantize_weight(q, s)).T).norm() / (x @ weight.T).norm()).item())

    def equal(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a == b).float().mean().item())

    q_loop, s_loop = whole(False)
    q_triton, s_triton = whole(True)
    swept_loop, _ = gptq._gptq_columns(w_perm.clone(), h_inv, 7, 128, 128, s_perm)
    return {
        "n": n,
        "k": k,
        "codes_equal": equal(q_loop, q_triton),
        # where they differ: each sweep on one inverse, and each whole rounding against itself run again (the
        # Hessian's inversion and the lazy updates' matmuls are the device libraries')
        "sweep_codes_equal": equal(swept_loop, sweep_columns(w_perm.clone(), h_inv, 7, s_perm, 128)),
        "loop_again_codes_equal": equal(q_loop, whole(False)[0]),
        "triton_again_codes_equal": equal(q_triton, whole(True)[0]),
        "output_error_loop": output_error(q_loop, s_loop),
        "output_error_triton": output_error(q_triton, s_triton),
        "gptq_quantize_loop_s": best_s(lambda: whole(False), repeat),
        "gptq_quantize_triton_s": best_s(lambda: whole(True), repeat),
        "sweep_loop_s": best_s(
            lambda: gptq._gptq_columns(w_perm.clone(), h_inv, 7, 128, 128, s_perm), repeat
        ),
        "sweep_triton_s": best_s(lambda: sweep_columns(w_perm.clone(), h_inv, 7, s_perm, 128), repeat),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES_NK), help="comma list of NxK"
    )
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = []
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        results.append(one_shape(n, k, args.repeat))
        print(json.dumps(results[-1]), flush=True)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "repeat": args.repeat,
        "results": results,
    }
    atomic_write_json(args.out, report)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
