"""Launch configurations of the int8-fp8 attention kernel at the served shapes, each checked and timed.

    python3 benchmarks/attention_tune.py --out attention_tune.json

At the two shapes ``--attention auto`` times (``ditq.doctor.attention.AUTO_SHAPES``: 4352 queries over 4352 keys,
and a 4-reference cached step's 4096 over 20736; Qwen-Image-2.1's 32 heads x 128), inputs drawn as
``attention_bench.py`` draws them: every launch configuration (block sizes, warps, pipeline stages; runs 1-3 also
compared a kernel reading its tiles through pointers, 3-5 % slower, and runs 6-7 kernel switches that were slower
too, each since removed: benchmarks/results/raw/attention_int8_fp8/README.md)
runs once against the reference arithmetic on the same quantized inputs (relative L2, the doctor's match bound for
the kind) and is then timed (median of ``triton.testing.do_bench``), V's quantization included as served. BF16 SDPA
through cuDNN is timed beside them. A variant that fails to compile or to match is recorded with why.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_bench import _inputs, _rel_l2, _sdpa
from kernels_bench import median_ms

MATCH_BOUND = 0.03  # the doctor's for int8-fp8
HEADS, HEAD_DIM = 32, 128


def _variants() -> list[dict[str, object]]:
    """Launch configurations: the H200 runs' best three (block sizes, warps, pipeline stages)."""
    grid = [(64, 128, 4, 3), (128, 128, 8, 3), (64, 128, 4, 2)]
    return [{"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st} for bm, bn, w, st in grid]


# opcode families: special functions and conversions, float arithmetic, integer adds, tensor-core products
_CONVERSION_OPS = ("MUFU", "I2F", "F2F", "F2FP", "HADD2")
_SASS_OPS = (*_CONVERSION_OPS, "FMUL", "FFMA", "FADD", "FMNMX", "IADD3", "QGMMA", "IGMMA")


def _sass_counts(kernel: object) -> dict[str, int]:
    """Static instruction counts of a compiled kernel (its whole SASS: the key loop and the last tile), by
    opcode family: the conversion and special-function work per tile, against the tensor-core instructions."""
    counts = dict.fromkeys(_SASS_OPS, 0)
    for line in kernel.asm["sass"].splitlines():  # type: ignore[attr-defined]
        # Triton's listing: "<stall and barrier fields>\t[@predicate] OPCODE.MODIFIERS operands;"
        words = line.rsplit("\t", 1)[-1].split()
        if words and words[0].startswith("@"):
            words = words[1:]
        family = words[0].split(".", 1)[0] if words else ""
        if family in counts:
            counts[family] += 1
    return counts


def _compiled(kernel_fn: object) -> set[object]:
    """Every compiled kernel in a Triton JIT function's per-device caches."""
    return {k for caches in kernel_fn.device_caches.values() for k in caches[0].values()}  # type: ignore[attr-defined]


def _shape_rows(queries: int, keys: int) -> list[dict[str, object]]:
    from torch.nn.attention import SDPBackend

    from ditq.kernels._triton.attention import _attention_pv8_kernel, attend_pv8, quantize_value
    from ditq.kernels.attention import attend_reference, get_attention_kernel

    path = get_attention_kernel("triton-attention-int8-fp8")
    q, k, v = _inputs(queries, keys, HEADS, HEAD_DIM, seed=keys)
    flops = 4 * queries * keys * HEADS * HEAD_DIM
    cudnn_ms = median_ms(lambda: _sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION))
    qk = path.quantize(q, k, path.kind)
    reference = attend_reference(qk, v, None, None, HEAD_DIM**-0.5)
    base = {"queries": queries, "keys": keys}
    rows: list[dict[str, object]] = [
        {**base, "variant": "sdpa-bf16-cudnn", "ms": cudnn_ms, "tflops": flops / cudnn_ms / 1e9}
    ]
    quantize_ms = median_ms(lambda: path.quantize(q, k, path.kind))
    rows.append({**base, "variant": "quantize Q and K", "ms": quantize_ms})
    ms = median_ms(lambda: quantize_value(v))
    rows.append({**base, "variant": "quantize V (inside each variant's time)", "ms": ms})
    seen = _compiled(_attention_pv8_kernel.fn)
    for config in _variants():
        name = " ".join(f"{key}={value}" for key, value in config.items())
        try:
            out = attend_pv8(qk, v, None, None, HEAD_DIM**-0.5, config=config)
            error = _rel_l2(out, reference)
            if not error <= MATCH_BOUND:
                rows.append({**base, "variant": name, "config": config, "error": f"rel-L2 {error:.3g}"})
                continue
            ms = median_ms(lambda c=config: attend_pv8(qk, v, None, None, HEAD_DIM**-0.5, config=c))
        except Exception as failure:  # a variant this compiler cannot build is recorded
            rows.append({**base, "variant": name, "config": config, "error": repr(failure)[:300]})
            continue
        new_kernels = _compiled(_attention_pv8_kernel.fn) - seen
        seen |= new_kernels
        sass: dict[str, object] = {}
        try:
            sass = {"sass": _sass_counts(next(iter(new_kernels)))} if len(new_kernels) == 1 else {}
        except Exception as failure:  # no disassembler on this machine: the timing stands without the counts
            sass = {"sass_error": repr(failure)[:200]}
        rows.append({**base, "variant": name, "config": config, "ms": ms, "tflops": flops / ms / 1e9,
                     "x_cudnn": ms / cudnn_ms, "total_x_cudnn": (ms + quantize_ms) / cudnn_ms,
                     "rel_l2_vs_reference": error, **sass})  # fmt: skip
    return rows


def _launch_once() -> int:
    """Each BLOCK_M=64 variant once at the 4-reference shape (after one launch that compiles it)."""
    from ditq.kernels._triton.attention import attend_pv8
    from ditq.kernels.attention import get_attention_kernel

    path = get_attention_kernel("triton-attention-int8-fp8")
    q, k, v = _inputs(4096, 20736, HEADS, HEAD_DIM, seed=0)
    qk = path.quantize(q, k, path.kind)
    for config in _variants():
        if config["BLOCK_M"] == 64:
            for _ in range(2):
                attend_pv8(qk, v, None, None, HEAD_DIM**-0.5, config=config)
            torch.cuda.synchronize()
            print("launched", config, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--once", action="store_true",
                        help="launch each variant once at the 4-reference shape, untimed (for a profiler)")  # fmt: skip
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_tune: needs a CUDA device", file=sys.stderr)
        return 2
    if args.once:
        return _launch_once()
    from ditq.doctor.attention import AUTO_SHAPES

    started = time.time()
    rows: list[dict[str, object]] = []
    for queries, keys in AUTO_SHAPES["cuda"]:
        rows += _shape_rows(queries, keys)
        print(f"{queries}x{keys} done at {time.time() - started:.0f}s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"command": " ".join(["python3", *sys.argv]), "gpu": torch.cuda.get_device_name(),
               "seconds": round(time.time() - started, 1), "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    for r in rows:
        shape = f"{r['queries']}x{r['keys']}"
        if "error" in r:
            print(f"{shape:>11} {r['variant']:<80} error: {r['error']}"[:200])
        else:
            extra = (
                f" {r['x_cudnn']:.2f}x cudnn, with Q/K {r['total_x_cudnn']:.2f}x" if "x_cudnn" in r else ""
            )
            flops_text = f" {r['tflops']:6.0f} TFLOPS" if "tflops" in r else ""
            print(f"{shape:>11} {r['variant']:<80} {r['ms']:7.3f} ms{flops_text}{extra}")
            if "sass" in r:
                print(" " * 12 + " ".join(f"{op} {n}" for op, n in r["sass"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
