"""Attention at Qwen-Image-2.1's real shapes, 1024x1024, 0-4 reference images: BF16 SDPA vs quantized attention.

    python3 benchmarks/attention_bench.py --out attention_bench.json

Per reference count r, the denoising step's attention of one layer with the prefix KV cache: the target's 4096
queries over [text, r x 4096 reference tokens, 4096 target tokens] keys (heads and head dim from the
transformer's default config, 32 x 128), padded prompt keys dropped; and, once, the prefill's block-causal
calls (``--prefill``). Rows:

- ``sdpa-bf16-flash`` / ``sdpa-bf16-cudnn``: torch SDPA on bf16 (FlashAttention / cuDNN backends; the
  padding mask, where there is one, is folded in by slicing it off: the rows use no mask);
- each quantized-attention path the registry offers for the kind (Triton, cuDNN's fp8 for fp8-fp8, the torch
  fallback), quantization of Q and K included (``total``) and the attention alone (``attend``); for the fused
  paths also ``total_compiled_ms``: quantization and attention under torch.compile (inductor), as a compiled
  server runs them, the quantization fused by the compiler.

Errors are relative L2 against float32 SDPA of the same (unquantized) inputs. Q/K/V are drawn to look like a
DiT's after RMSNorm and RoPE: standard normal, keys with a shared per-channel offset (what smoothing removes),
queries scaled so that attention is peaked (softmax entropy well below uniform). Times are medians of
triton.testing.do_bench (CUDA events). Per image = one layer's step attention x layers x steps is printed as a
guide; the model's other work is not timed here.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_bench import median_ms

IMAGE_TOKENS = 4096  # 1024x1024 at 16 pixels per token


def _model_shape() -> tuple[int, int, int]:
    """(heads, head dim, layers) from QwenImage21Transformer2DModel's defaults."""
    from diffusers import QwenImage21Transformer2DModel

    params = inspect.signature(QwenImage21Transformer2DModel.__init__).parameters
    return (params["num_attention_heads"].default, params["attention_head_dim"].default,
            params["num_layers"].default)  # fmt: skip


def _inputs(seq_q: int, seq_kv: int, heads: int, head_dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (1, seq_kv, heads, head_dim)
    k = torch.randn(shape, generator=g, device="cuda") + 2.0 * torch.randn(
        1, 1, heads, head_dim, generator=g, device="cuda"
    )
    v = torch.randn(shape, generator=g, device="cuda")
    q = 2.0 * torch.randn((1, seq_q, heads, head_dim), generator=g, device="cuda")
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: object | None) -> torch.Tensor:
    from torch.nn.attention import sdpa_kernel

    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def _tuned(path_name: str) -> dict[str, str]:
    """The Triton autotuner's choice for the kernel a path last ran (none for other paths)."""
    if not path_name.startswith("triton-"):
        return {}
    from ditq.kernels._triton import attention

    kernel = (
        attention._attention_pv8_kernel if path_name.endswith("int8-fp8") else attention._attention_kernel
    )
    return {"triton_config": str(getattr(kernel, "best_config", None))}


def _compiled(path: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, float]:
    """Quantization and attention under torch.compile (inductor, dynamic shapes as a server compiles), for the
    fused paths (not the torch fallback, whose float32 scores inductor would materialise)."""
    if path.name.startswith("cuda-torch-"):  # type: ignore[attr-defined]
        return {}

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return path.attend(path.quantize(q, k, path.kind), v, None, None, q.shape[-1] ** -0.5)  # type: ignore[attr-defined]

    try:
        compiled = torch.compile(attention, dynamic=True)
        compiled(q, k, v)
        return {"total_compiled_ms": median_ms(lambda: compiled(q, k, v))}
    except Exception as error:  # recorded beside the eager numbers, not in their place
        return {"compiled_error": f"{type(error).__name__}: {error}"[:300]}  # type: ignore[dict-item]


def _step_rows(refs: int, text: int, heads: int, head_dim: int, kinds: list[str]) -> list[dict[str, object]]:
    from torch.nn.attention import SDPBackend

    from ditq.doctor.attention import choose_attention_kernel
    from ditq.kernels.attention import candidate_attention_paths

    seq_kv = text + (refs + 1) * IMAGE_TOKENS
    q, k, v = _inputs(IMAGE_TOKENS, seq_kv, heads, head_dim, seed=refs)
    reference = _sdpa(q.float(), k.float(), v.float(), None)
    flops = 4 * IMAGE_TOKENS * seq_kv * heads * head_dim
    rows: list[dict[str, object]] = []
    base = {"refs": refs, "seq_q": IMAGE_TOKENS, "seq_kv": seq_kv, "heads": heads, "head_dim": head_dim}
    for name, backend in (
        ("sdpa-bf16-flash", SDPBackend.FLASH_ATTENTION),
        ("sdpa-bf16-cudnn", SDPBackend.CUDNN_ATTENTION),
    ):
        try:
            out = _sdpa(q, k, v, backend)
            ms = median_ms(lambda b=backend: _sdpa(q, k, v, b))
            rows.append({**base, "path": name, "total_ms": ms, "attend_ms": ms, "tflops": flops / ms / 1e9,
                         "rel_l2_vs_fp32": _rel_l2(out, reference)})  # fmt: skip
        except Exception as error:  # a backend this build lacks is recorded, not fatal
            rows.append({**base, "path": name, "error": f"{type(error).__name__}: {error}"[:300]})
    for kind in kinds:
        chosen = choose_attention_kernel(kind, "cuda", torch.bfloat16, head_dim).path.name
        for path in candidate_attention_paths(kind, "cuda", torch.bfloat16, head_dim):
            try:
                qk = path.quantize(q, k, kind)
                out = path.attend(qk, v, None, None, head_dim**-0.5)
                attend_ms = median_ms(lambda p=path, qk=qk: p.attend(qk, v, None, None, head_dim**-0.5))
                total_ms = median_ms(
                    lambda p=path: p.attend(p.quantize(q, k, p.kind), v, None, None, head_dim**-0.5)
                )
                rows.append({**base, "path": path.name, "kind": kind, "chosen": path.name == chosen,
                             "total_ms": total_ms, "attend_ms": attend_ms, "tflops": flops / attend_ms / 1e9,
                             "rel_l2_vs_fp32": _rel_l2(out, reference), **_tuned(path.name),
                             **_compiled(path, q, k, v)})  # fmt: skip
            except Exception as error:
                rows.append(
                    {
                        **base,
                        "path": path.name,
                        "kind": kind,
                        "error": f"{type(error).__name__}: {error}"[:300],
                    }
                )
    return rows


def _prefill_rows(
    refs: int, text: int, heads: int, head_dim: int, kinds: list[str]
) -> list[dict[str, object]]:
    """The prefill's calls (text causal, each reference over keys up to its end, the target over everything)."""
    from ditq.kernels.attention import candidate_attention_paths
    from ditq.runtime.models.qwenimage21.prefill import quantized_segment_attention

    seq = text + (refs + 1) * IMAGE_TOKENS
    q, k, v = _inputs(seq, seq, heads, head_dim, seed=100 + refs)
    segments = [(0, text, True)] + [
        (text + i * IMAGE_TOKENS, text + (i + 1) * IMAGE_TOKENS, False) for i in range(refs)
    ]

    def sdpa_segments() -> torch.Tensor:
        outs = [_sdpa(q[:, s:e], k[:, :e], v[:, :e], None) if not t else
                F.scaled_dot_product_attention(q[:, s:e].transpose(1, 2), k[:, :e].transpose(1, 2), v[:, :e].transpose(1, 2),
                                               attn_mask=torch.ones(e - s, e, dtype=torch.bool, device="cuda").tril(s)).transpose(1, 2)
                for s, e, t in segments]  # fmt: skip
        outs.append(_sdpa(q[:, segments[-1][1] :], k, v, None))
        return torch.cat(outs, dim=1)

    rows: list[dict[str, object]] = [
        {"refs": refs, "seq": seq, "path": "sdpa-bf16 (prefill)", "total_ms": median_ms(sdpa_segments)}
    ]
    for kind in kinds:
        path = candidate_attention_paths(kind, "cuda", torch.bfloat16, head_dim)[0]
        ms = median_ms(lambda p=path: quantized_segment_attention(p, q, k, v, segments, None))
        rows.append({"refs": refs, "seq": seq, "path": f"{path.name} (prefill)", "total_ms": ms})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--refs", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="reference counts")
    parser.add_argument(
        "--text-tokens", type=int, default=256, help="prompt tokens in the prefix (default 256)"
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=["int8", "fp8", "int8-fp8", "fp8-fp8"],
        choices=["int8", "fp8", "int8-fp8", "fp8-fp8"],
    )
    parser.add_argument(
        "--steps", type=int, default=50, help="denoising steps for the per-image guide (default 50)"
    )
    parser.add_argument("--prefill", action="store_true", help="also time the prefill's block-causal calls")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_bench: needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    heads, head_dim, layers = _model_shape()
    started = time.time()
    rows: list[dict[str, object]] = []
    for refs in args.refs:
        rows += _step_rows(refs, args.text_tokens, heads, head_dim, args.kinds)
        if args.prefill:
            rows += _prefill_rows(refs, args.text_tokens, heads, head_dim, args.kinds)
        print(f"refs={refs} done at {time.time() - started:.0f}s", flush=True)
    commit = (
        subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    )
    payload = {
        "command": " ".join(["python3", *sys.argv]),
        "git_commit": commit,
        "environment": {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "model": {
            "heads": heads,
            "head_dim": head_dim,
            "layers": layers,
            "image_tokens": IMAGE_TOKENS,
            "text_tokens": args.text_tokens,
            "steps": args.steps,
        },
        "seconds": time.time() - started,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    flash = {r["refs"]: r["total_ms"] for r in rows if r["path"] == "sdpa-bf16-flash" and "total_ms" in r}
    cudnn = {r["refs"]: r["total_ms"] for r in rows if r["path"] == "sdpa-bf16-cudnn" and "total_ms" in r}
    print(
        f"{'refs':>4} {'path':<30} {'total ms':>9} {'attend ms':>9} {'x flash':>7} {'x cudnn':>7} {'TFLOPS':>7} "
        f"{'rel-L2':>8} {'s/image':>8} {'compiled':>8} {'c x cudnn':>9}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['refs']:>4} {r['path']:<30} error: {r['error']}")
            continue
        if "attend_ms" not in r:
            print(f"{r['refs']:>4} {r['path']:<30} {r['total_ms']:>9.3f}")
            continue
        ratio = r["total_ms"] / flash[r["refs"]] if r["refs"] in flash else float("nan")
        to_cudnn = r["total_ms"] / cudnn[r["refs"]] if r["refs"] in cudnn else float("nan")
        per_image = r["total_ms"] * layers * args.steps / 1000
        compiled = r.get("total_compiled_ms", float("nan"))
        c_cudnn = compiled / cudnn[r["refs"]] if r["refs"] in cudnn else float("nan")
        print(f"{r['refs']:>4} {r['path']:<30} {r['total_ms']:>9.3f} {r['attend_ms']:>9.3f} {ratio:>7.2f} "
              f"{to_cudnn:>7.2f} {r['tflops']:>7.0f} {r['rel_l2_vs_fp32']:>8.4f} {per_image:>8.2f} "
              f"{compiled:>8.3f} {c_cudnn:>9.3f}")  # fmt: skip
    print(f"wrote {args.out} in {time.time() - started:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
