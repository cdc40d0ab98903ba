"""Host time per call of each CUDA kernel path, beside its device time: what an eager denoising step pays per Linear.

    python benchmarks/kernels_host_overhead.py --out benchmarks/results/kernels_host_overhead_CARD_COMMIT.json

For each shape and each ditq path the registry offers (and BF16 ``F.linear``): ``host_us`` is the wall time of
enqueuing ``--calls`` calls back to back without synchronizing, divided by the calls (the host's cost of one call
while the device has work queued: Python, the custom-op dispatch, the Triton launcher, the autotuner's lookup);
``device_us`` the median device time of one call (``triton.testing.do_bench``). A path whose host time exceeds its
device time starves the device in eager mode. The parts of the persistent W8A8 path are timed the same way, and a
cProfile of its calls lists where the host time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernels_bench  # noqa: E402

SHAPES = [(4096, 3072, 3072), (4096, 3072, 12288), (4096, 12288, 3072)]  # M, K, N: the DiT's cached step


def host_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def device_us(fn: Callable[[], object]) -> float:
    return kernels_bench.median_ms(fn) * 1000


def measure_shape(
    m: int, k: int, n: int, calls: int, want_profile: bool
) -> tuple[list[dict[str, object]], str]:
    """The rows of one shape, and (``want_profile``) a cProfile of 100 calls of the persistent W8A8 path."""
    from ditq.kernels._triton.w8a8_gemm import w8a8_gemm_persistent
    from ditq.kernels.cuda_common import quantize_rows
    from ditq.schemes import get_scheme

    cuda = torch.device("cuda")
    rows: list[dict[str, object]] = []
    profile_text = ""
    torch.manual_seed(0)
    x = torch.randn(m, k, device=cuda, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=cuda, dtype=torch.bfloat16) * 0.02

    def record(name: str, fn: Callable[[], object]) -> None:
        rows.append({"M": m, "K": k, "N": n, "path": name, "host_us": round(host_us(fn, calls), 1),
                     "device_us": round(device_us(fn), 1)})  # fmt: skip
        print(rows[-1], flush=True)

    record("bf16 F.linear", lambda: torch.nn.functional.linear(x, w))
    for scheme_name in ("w8a8", "fp8"):
        for path, prepared in kernels_bench.prepared_paths(w, get_scheme(scheme_name)):
            record(f"ditq:{path.name}", lambda p=path, pr=prepared: p.matmul(x, pr, None))
            if path.name != "triton-w8a8-persistent":
                continue
            x_q, x_scale = quantize_rows(x, "int8")
            scale_1d = x_scale.reshape(-1)
            record("part: quantize_rows int8", lambda: quantize_rows(x, "int8"))
            record("part: w8a8_gemm_persistent (no custom op)",
                   lambda pr=prepared, a=x_q, sa=scale_1d: w8a8_gemm_persistent(
                       a, pr["weight"], sa, pr["weight_scale"], None, torch.bfloat16))  # fmt: skip
            record("part: custom op ditq::w8a8_triton_persistent",
                   lambda pr=prepared, a=x_q, sa=scale_1d: torch.ops.ditq.w8a8_triton_persistent(
                       a, sa, pr["weight"], pr["weight_scale"], None, torch.bfloat16))  # fmt: skip
            if want_profile:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(100):
                    path.matmul(x, prepared, None)
                profiler.disable()
                torch.cuda.synchronize()
                stream = io.StringIO()
                pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(25)
                profile_text = stream.getvalue()
    return rows, profile_text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()

    rows: list[dict[str, object]] = []
    profile_text = ""
    for m, k, n in SHAPES:
        found, text = measure_shape(m, k, n, args.calls, want_profile=not profile_text)
        rows += found
        profile_text = profile_text or text
    result = {
        "command": "python " + " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "fields": {"host_us": "enqueue wall time per call, no sync", "device_us": "do_bench median per call"},
        "rows": rows,
        "cprofile_triton_w8a8_persistent_100_calls": profile_text.splitlines()[:60],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(profile_text[:6000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
