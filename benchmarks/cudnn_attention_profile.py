"""Where cuDNN's fp8 attention path spends its time at Qwen-Image-2.1's served shapes (32 heads x 128, the target's
4096 queries over 4352 keys with no references and 20736 with four).

    python3 benchmarks/cudnn_attention_profile.py --out cudnn_attention_profile.json

Rows per shape: cuDNN's BF16 SDPA through torch; ditq's cuDNN fp8 op on inputs already quantized, (B, S, H, D) as the
model holds them and (B, H, S, D) contiguous; the path's whole call (quantization of Q, K and V, the op, the output's
dequantization), eager and compiled. Times are medians of triton.testing.do_bench (CUDA events, host gaps included);
``device_ms`` is the sum of the kernels' device time per call under torch.profiler, by kernel, so that host time
(``ms - device_ms``) and each kernel's share show apart.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

QUERIES, HEADS, HEAD_DIM = 4096, 32, 128
SHAPES = {"0 refs": 4352, "4 refs": 20736}


def _kernels(call: Callable[[], object], calls: int = 10) -> tuple[float, dict[str, float]]:
    """(device ms per call, kernel name -> device ms per call) under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    by_name: dict[str, float] = {}
    for event in prof.key_averages():
        if event.device_type.name == "CUDA" and event.self_device_time_total > 0:
            by_name[event.key[:90]] = round(event.self_device_time_total / 1000 / calls, 4)
    return round(sum(by_name.values()), 4), dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:8])


def _row(name: str, call: Callable[[], object]) -> dict[str, object]:
    import triton

    ms = triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median")
    device_ms, kernels = _kernels(call)
    print(f"  {name:<44} {ms:8.3f} ms  device {device_ms:8.3f} ms", flush=True)
    return {"row": name, "ms": round(ms, 4), "device_ms": device_ms, "kernels": kernels}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from ditq.kernels.attention import get_attention_kernel

    path = get_attention_kernel("cudnn-attention-fp8-fp8")
    ok, why = path.supports(torch.device("cuda"), torch.bfloat16, HEAD_DIM)
    if not ok:
        print(f"cudnn_attention_profile: {why}", file=sys.stderr)
        return 2
    rows = {label: _shape_rows(path, keys) for label, keys in SHAPES.items()}
    commit = (
        subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    )
    payload = {"command": " ".join(["python3", *sys.argv]), "git_commit": commit, "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__, "shapes": {k: [QUERIES, v, HEADS, HEAD_DIM] for k, v in SHAPES.items()},
               "rows": rows}  # fmt: skip
    from ditq.fsutil import atomic_write_json

    atomic_write_json(args.out, payload)
    return 0


def _shape_rows(path: object, keys: int) -> list[dict[str, object]]:
    """Every row at one key count."""
    from ditq.kernels.attention.cudnn import _sdpa_fp8
    from ditq.kernels.attention.reference import quantize_per_tensor

    print(f"{keys} keys", flush=True)
    g = torch.Generator(device="cuda").manual_seed(keys)
    q = torch.randn(1, QUERIES, HEADS, HEAD_DIM, generator=g, device="cuda").bfloat16()
    k, v = (torch.randn(1, keys, HEADS, HEAD_DIM, generator=g, device="cuda").bfloat16() for _ in range(2))
    (q8, qs), (k8, ks), (v8, vs) = (quantize_per_tensor(x) for x in (q, k, v))
    o_scale = (2 * vs).reciprocal()
    scale = HEAD_DIM**-0.5
    bhsd = _interleave([x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q8, k8, v8)], (qs, ks, vs))

    def whole() -> torch.Tensor:
        return path.attend(path.quantize(q, k, path.kind), v, None, None, scale)  # type: ignore[attr-defined]

    compiled = torch.compile(whole)
    return [
        _row("sdpa bf16 (cuDNN backend)", lambda: _sdpa(q, k, v)),
        _row(
            "cuDNN fp8 op, quantized inputs, BSHD", lambda: _sdpa_fp8(q8, qs, k8, ks, v8, vs, o_scale, scale)
        ),
        _row("cuDNN fp8 op, quantized inputs, BHSD", lambda: _sdpa_fp8(*bhsd, o_scale, scale)),
        _row("quantize Q, K, V (eager)", lambda: (path.quantize(q, k, "fp8-fp8"), quantize_per_tensor(v))),  # type: ignore[attr-defined]
        _row("path: quantize + attend, eager", whole),
        _row("path: quantize + attend, compiled", compiled),
    ]


def _interleave(tensors: list[torch.Tensor], scales: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [t for pair in zip(tensors, scales, strict=True) for t in pair]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


if __name__ == "__main__":
    raise SystemExit(main())
