"""What a new attention shape costs the first time, by SDPA backend: the suspect in a served fixture's slower first request.

    python benchmarks/sdpa_first_call.py --out benchmarks/results/sdpa_first_call_h200.json

A served request's prompt length sets the sequence lengths of the text encoder's attention, the prefix step's prompt
segment and every cached step's keys (the prompt's tokens, the references', the image's), so a prompt of a length not
served before brings shapes no attention call has run. cuDNN's fused attention builds (and caches) an execution plan
per shape; the flash and memory-efficient kernels have none. For each backend and each of several sequence lengths no
backend has seen, this times the first call at that length and the median of the calls after it (wall time, the
device synchronized), at the full-size DiT's head layout (32 heads of 128, BF16): the cached step's image queries over
the image and a prompt's keys, and the prompt segment attending to itself.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ditq.fsutil import atomic_write_json

BACKENDS = {
    "default": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
HEADS, HEAD_DIM, IMAGE_TOKENS = 32, 128, 4096


def timed_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: SDPBackend | None) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    if backend is None:
        F.scaled_dot_product_attention(q, k, v)
    else:
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000


def measure(
    name: str, backend: SDPBackend | None, prompt_lengths: list[int], repeats: int
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for prompt in prompt_lengths:
        for shape, (queries, keys) in {
            "cached_step": (IMAGE_TOKENS, IMAGE_TOKENS + prompt),
            "prompt_segment": (prompt, prompt),
        }.items():
            q = torch.randn(1, HEADS, queries, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(1, HEADS, keys, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            first = timed_ms(q, k, v, backend)
            later = [timed_ms(q, k, v, backend) for _ in range(repeats)]
            rows.append(
                {
                    "backend": name,
                    "shape": shape,
                    "queries": queries,
                    "keys": keys,
                    "first_ms": round(first, 3),
                    "later_median_ms": round(statistics.median(later), 3),
                }
            )
            print(
                f"{name:9s} {shape:14s} q {queries:5d} k {keys:5d}: first {first:8.2f} ms, then {rows[-1]['later_median_ms']:.3f} ms"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", type=int, default=4, help="new prompt lengths per backend (default 4)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    # a warm-up at a length no measured row uses: the CUDA context, cuBLAS and the kernels' modules load here
    for backend in BACKENDS.values():
        measure("warm-up", backend, [64], 1)
    rows: list[dict[str, object]] = []
    for index, (name, backend) in enumerate(BACKENDS.items()):
        # every backend its own lengths, none shared: no plan one backend built can serve another's rows
        lengths = [97 + 13 * (index * args.lengths + i) for i in range(args.lengths)]
        rows += measure(name, backend, lengths, args.repeats)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "rows": rows,
    }
    atomic_write_json(args.out, result, indent=1)


if __name__ == "__main__":
    main()
