"""GEMM throughput at DiT shapes: every ditq CUDA kernel path vs BF16 cuBLAS, torch._int_mm and torchao.

    python benchmarks/kernels_bench.py --out benchmarks/results/kernels_bench_CARD_COMMIT.json

Shapes: M in {4352, 20736} x (K, N) in {(4096, 12288), (4096, 4096), (12288, 4096)}.
Each ditq path the registry offers for the shape (``candidate_paths``, DITQ_KERNELS /
DITQ_DISABLE_KERNELS honoured) is timed end to end through its matmul on bf16 input (activation
quantization included for w8a8/fp8), and the row of the path that ``ditq serve`` would choose for
that shape (``ditq.doctor.choose_kernel``) says ``"chosen": true``; raw library GEMMs on
pre-quantized operands are listed as ceilings (fp8 rowwise with and without cuBLAS fast accumulation, and on sm_90
cuBLAS's 1x128 blockwise scaling, which w4a8's groups of 128 run on), w4a8 stored with one scale per output channel
beside the grouped one (``--group-size channel``: the rowwise GEMM), and ditq's
activation quantization alone as a part of the ditq rows' time (its TFLOP/s column counts the GEMM's
operations, so read its ms). Times are medians of triton.testing.do_bench (CUDA events); TFLOP/s = 2*M*N*K / t.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ditq.kernels import KernelPath
    from ditq.kernels.registry import Prepared
    from ditq.schemes import Scheme

SHAPES_KN = [(4096, 12288), (4096, 4096), (12288, 4096)]
SHAPES_M = [4352, 20736]
# --shapes four-bit: the full-size transformer's and text encoder's Linears (K, N: hidden 4096, MLP 12288, the
# text encoder's key/value 1024) at the token counts 4-bit serving meets: a prompt (16, 256), a cached step at
# 1024x1024 (4096 target tokens), a prefix step with 4 references (20736); 1024 between, where the w4a8 paths split
FOUR_BIT_KN = [(4096, 12288), (4096, 4096), (12288, 4096), (4096, 1024)]
FOUR_BIT_M = [16, 256, 1024, 4096, 20736]
SHAPE_SETS = {"seed": (SHAPES_M, SHAPES_KN), "four-bit": (FOUR_BIT_M, FOUR_BIT_KN)}


def median_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _environment() -> dict[str, object]:
    import triton

    env: dict[str, object] = {
        "gpu": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
    try:
        import torchao

        env["torchao"] = torchao.__version__
    except Exception as error:  # recorded, not fatal: torchao rows are then absent
        env["torchao"] = f"unavailable: {error!r}"[:300]
    return env


def _torchao_fns(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """torchao int8 dynamic (eager, compiled) and fp8 rowwise (eager, compiled) Linears over the same weight."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8DynamicActivationInt8WeightConfig,
        PerRow,
        quantize_,
    )

    fns: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for label, config in (
        ("torchao-int8dyn", Int8DynamicActivationInt8WeightConfig()),
        ("torchao-fp8-rowwise", Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())),
    ):
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        linear.weight.data.copy_(w)
        quantize_(linear, config)
        fns[f"{label}-eager"] = linear
        fns[f"{label}-compiled"] = torch.compile(linear, dynamic=False)
    return fns


def prepared_paths(
    w: torch.Tensor, scheme: Scheme, stored_as: Scheme | None = None, only: str | None = None
) -> Iterator[tuple[KernelPath, Prepared]]:
    """Each CUDA path the registry offers for ``scheme`` at w's shape (N, K) (or the one named ``only``), with w
    quantized as ``ditq quantize`` stores it (as ``stored_as``, another grouping of the scheme, where given) and
    repacked by the path, as the loader does."""
    from ditq.checkpoint.codecs import codec_for
    from ditq.kernels import candidate_paths
    from ditq.numerics import quantize_weight

    n, k = w.shape
    for path in candidate_paths(scheme, w.device, torch.bfloat16, k, n):
        if only is not None and path.name != only:
            continue
        q, scale = quantize_weight(w.float(), (stored_as or path.scheme).fitted(k))
        stored = {key: t.to(w.device) for key, t in codec_for(path.scheme).encode(q, scale).items()}
        yield path, path.prepare(stored, w.device)


def _rows_for_shape(
    m: int, k: int, n: int, torchao_ok: bool, only: list[str], schemes: list[str]
) -> list[dict[str, object]]:
    from ditq.doctor import choose_kernel
    from ditq.numerics import quantize_weight, relative_l2
    from ditq.schemes import SCHEMES, get_scheme

    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    flops = 2.0 * m * n * k
    ref = torch.nn.functional.linear(x, w)
    rows: list[dict[str, object]] = []
    torch._dynamo.reset()  # each shape's torchao modules compile afresh (no recompile-limit fallback to eager)

    def record(
        name: str, kind: str, fn: Callable[[], torch.Tensor], check: bool = True, **extra: object
    ) -> None:
        if only and not any(part in name for part in only):
            return
        try:
            out = fn()
            error = relative_l2(out, ref) if check else None
            ms = median_ms(fn)
            rows.append({"M": m, "K": k, "N": n, "path": name, "kind": kind, "ms": ms,
                         "tflops": flops / ms / 1e9, "rel_l2_vs_bf16": error, **extra})  # fmt: skip
        except Exception as exc:
            rows.append({"M": m, "K": k, "N": n, "path": name, "kind": kind, "error": repr(exc)[:500]})
            traceback.print_exc()

    record("bf16-cublas", "baseline", lambda: torch.nn.functional.linear(x, w))

    # Raw library GEMMs on pre-quantized operands (no activation quantization): ceilings.
    w_i8 = quantize_weight(w, get_scheme("w8a8"))[0]
    x_i8 = torch.randint(-127, 128, (m, k), device="cuda", dtype=torch.int8)
    record("torch._int_mm (raw, no quant)", "ceiling", lambda: torch._int_mm(x_i8, w_i8.t()), check=False)
    w_f8 = quantize_weight(w, get_scheme("fp8"))[0]
    x_f8 = x.to(torch.float8_e4m3fn)
    one_a = torch.ones(m, 1, device="cuda")
    one_b = torch.ones(1, n, device="cuda")
    record("torch._scaled_mm rowwise (raw, no quant)", "ceiling",
           lambda: torch._scaled_mm(x_f8, w_f8.t(), scale_a=one_a, scale_b=one_b, out_dtype=torch.bfloat16,
                                    use_fast_accum=True), check=False)  # fmt: skip
    record("torch._scaled_mm rowwise (raw, no quant, full accumulation)", "ceiling",
           lambda: torch._scaled_mm(x_f8, w_f8.t(), scale_a=one_a, scale_b=one_b, out_dtype=torch.bfloat16,
                                    use_fast_accum=False), check=False)  # fmt: skip
    if torch.cuda.get_device_capability() >= (9, 0) and k % 128 == 0 and m % 4 == 0:
        # cuBLAS's 1x128 blockwise scaling (sm_90), as widen-scaled-mm-w4a8 calls it for groups of 128: the same
        # operands as the rowwise rows, one scale per 128 of K for each token and each output channel
        blocks_a = torch.ones(k // 128, m, device="cuda").t()
        blocks_b = torch.ones(k // 128, n, device="cuda")
        record("torch._scaled_mm blockwise 1x128 (raw, no quant)", "ceiling",
               lambda: torch._scaled_mm(x_f8, w_f8.t(), scale_a=blocks_a, scale_b=blocks_b, out_dtype=torch.bfloat16),
               check=False)  # fmt: skip
    # The per-token activation quantization alone (what the eager ditq rows run before their GEMM): the parts
    # of each ditq row's time, with the raw rows above.
    from ditq.kernels.cuda_common import quantize_rows

    for kind in ("int8", "fp8"):
        record(f"ditq activation quantization {kind} (alone)", "part",
               lambda kind=kind: quantize_rows(x, kind)[0], check=False)  # fmt: skip

    cuda = torch.device("cuda")
    for scheme in SCHEMES.values():
        if schemes and scheme.name not in schemes:
            continue
        try:  # the one kernel-choice policy, as ditq serve applies it to a layer of this shape
            chosen: str | None = choose_kernel(scheme, cuda, torch.bfloat16, k, n).path.name
        except Exception:
            chosen = None  # no path passed the doctor here (its warnings name the reports)
            traceback.print_exc()
        for path, prepared in prepared_paths(w, scheme):
            record(f"ditq:{path.name}", path.scheme.name, lambda p=path, pr=prepared: p.matmul(x, pr, None),
                   chosen=path.name == chosen)  # fmt: skip
            if path.name == "widen-scaled-mm-w4a8":  # both sides of its split at every token count
                from ditq.kernels import w4_triton
                from ditq.kernels._triton.w4_gemm import widen_int4_fp8

                def widened_always(pr: Prepared = prepared, p: KernelPath = path) -> torch.Tensor:
                    names = ("W4A8_WIDEN_MIN_ROWS", "W4A8_WIDEN_MIN_WORK", "W4A8_WIDEN_MIN_WEIGHTS")
                    kept = [getattr(w4_triton, name) for name in names]
                    for name in names:
                        setattr(w4_triton, name, 0)
                    try:
                        return p.matmul(x, pr, None)
                    finally:
                        for name, value in zip(names, kept, strict=True):
                            setattr(w4_triton, name, value)

                record("w4a8 widened + cuBLAS at any M (variant)", "variant", widened_always)
                record("w4a8 widening to e4m3 alone", "part", lambda pr=prepared: widen_int4_fp8(pr["weight"]),
                       check=False)  # fmt: skip
            if path.name == "triton-w4a8":  # the other widening, measured against the shipped one
                from ditq.kernels._triton.w4_gemm import w4_gemm
                from ditq.kernels.w4_triton import block_k_for

                def shifts_widening(pr: Prepared = prepared) -> torch.Tensor:
                    x_q, x_scale = quantize_rows(x, "fp8")
                    return w4_gemm(x_q, x_scale.reshape(-1), pr["weight"], pr["weight_scale"], None,
                                   torch.bfloat16, block_k_for(k, pr["weight_scale"].shape[1]) or 128,
                                   magic=False)  # fmt: skip

                record("w4a8 shifts widening (not shipped)", "variant", shifts_widening)
            del prepared
        if scheme.num_bits == 4 and scheme.activations is not None:
            # the same scheme stored with one scale per output channel (ditq quantize --group-size channel): the
            # widened path's GEMM is then cuBLAS's rowwise one
            for path, prepared in prepared_paths(
                w, scheme, scheme.with_group_size(None), "widen-scaled-mm-w4a8"
            ):
                record(f"ditq:{path.name} per channel", f"{scheme.name}-channel",
                       lambda p=path, pr=prepared: p.matmul(x, pr, None))  # fmt: skip
                del prepared

    if torchao_ok:
        try:
            fns = _torchao_fns(w)
        except Exception as exc:
            rows.append({"M": m, "K": k, "N": n, "path": "torchao", "error": repr(exc)[:500]})
            fns = {}
        for name, fn in fns.items():
            record(name, "torchao", lambda f=fn: f(x))
    return rows


def _triton_best_configs() -> dict[str, object]:
    """The autotuner's choice per key for each ditq Triton GEMM (the variant sweep's outcome)."""
    from ditq.kernels._triton import act_quant, w4_gemm, w8a8_gemm, w8a16_gemm

    found: dict[str, object] = {}
    for label, kernel in (
        ("w8a8_ptr", w8a8_gemm._w8a8_kernel),
        ("w8a8_tma", w8a8_gemm._w8a8_tma_kernel),
        ("w8a8_persistent", w8a8_gemm._w8a8_persistent_kernel),
        ("w8a16", w8a16_gemm._w8a16_kernel),
        ("w4", w4_gemm._w4_kernel),
        ("activation_quantization", act_quant._act_quant_kernel),
    ):
        found[label] = {str(key): str(config) for key, config in kernel.cache.items()}
    return found


def _table(rows: list[dict[str, object]]) -> str:
    base = {
        (r["M"], r["K"], r["N"]): r["tflops"] for r in rows if r["path"] == "bf16-cublas" and "tflops" in r
    }
    lines = [f"{'M':>6} {'K':>6} {'N':>6}  {'path':<44} {'ms':>8} {'TFLOP/s':>8} {'x bf16':>7} {'relL2':>8}"]
    for r in rows:
        if "tflops" not in r:
            lines.append(
                f"{r['M']:>6} {r['K']:>6} {r['N']:>6}  {r['path']:<44} ERROR {r.get('error', '')[:60]}"
            )
            continue
        ratio = r["tflops"] / base[(r["M"], r["K"], r["N"])]
        err = "" if r["rel_l2_vs_bf16"] is None else f"{r['rel_l2_vs_bf16']:.2e}"
        lines.append(
            f"{r['M']:>6} {r['K']:>6} {r['N']:>6}  {r['path']:<44} {r['ms']:>8.3f} {r['tflops']:>8.1f} {ratio:>7.2f} {err:>8}"
        )
    return "\n".join(lines)


FOUR_BIT_LABELS = ("w4a8", "w4a8-channel", "fp8", "w4a16")  # the row kinds four_bit_ratios compares


def four_bit_ratios(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Per shape: ditq w4a8's TFLOP/s over the best ditq fp8 path's (issue 46's goal: at least 0.9), the same for
    w4a8 stored per output channel, and the best w4a16 path's over BF16 cuBLAS, from one run's rows."""
    best: dict[tuple[object, ...], float] = {}
    for r in rows:
        if "tflops" not in r:
            continue
        kind = str(r["kind"])
        label = "bf16" if r["path"] == "bf16-cublas" else kind if kind in FOUR_BIT_LABELS else None
        if label is not None and str(r["path"]).startswith(("ditq:", "bf16")):
            key = (r["M"], r["K"], r["N"], label)
            best[key] = max(best.get(key, 0.0), float(r["tflops"]))  # type: ignore[arg-type]
    out = []
    for m, k, n in sorted({key[:3] for key in best}):  # type: ignore[type-var]
        get = {label: best.get((m, k, n, label)) for label in (*FOUR_BIT_LABELS, "bf16")}
        out.append({"M": m, "K": k, "N": n,
                    "w4a8_x_fp8": None if not (get["w4a8"] and get["fp8"]) else round(get["w4a8"] / get["fp8"], 3),
                    "w4a8_channel_x_fp8": None if not (get["w4a8-channel"] and get["fp8"])
                    else round(get["w4a8-channel"] / get["fp8"], 3),
                    "w4a16_x_bf16": None if not (get["w4a16"] and get["bf16"]) else round(get["w4a16"] / get["bf16"], 3)})  # fmt: skip
    return out


GOALS = {"w8a8": 1.6, "fp8": 1.75}  # throughput vs BF16 cuBLAS at every benchmarked shape (issue 16)


def summarize(runs: list[dict[str, object]], exclude: dict[str, str]) -> dict[str, object]:
    """Per shape: BF16, each comparator and each ditq path (latest run that measured it), ratios, goals.

    ``exclude`` maps "path@M,K,N" to why that measurement is not valid (it is left out of the summary).
    """
    from ditq.kernels import all_kernels

    shipped = {f"ditq:{p.name}": p.scheme.name for p in all_kernels()}
    latest: dict[tuple[int, int, int, str], dict[str, object]] = {}
    for index, run in enumerate(runs):
        for row in run["rows"]:  # type: ignore[union-attr]
            if row["path"].startswith("ditq:") and row["path"] not in shipped:
                continue  # a path no longer registered (its rows stay in the raw runs)
            if f"{row['path']}@{row['M']},{row['K']},{row['N']}" in exclude:
                continue
            if "tflops" in row:
                key = (row["M"], row["K"], row["N"], row["path"])
                earlier = latest[key]["all_runs"] if key in latest else []
                latest[key] = dict(row, run=index, all_runs=[*earlier, (index, row["tflops"])])
    # Ratios against BF16 of the same run and shape (runs may be on different machines).
    bf16 = {
        (index, row["M"], row["K"], row["N"]): row["tflops"]
        for index, run in enumerate(runs)
        for row in run["rows"]  # type: ignore[union-attr]
        if row["path"] == "bf16-cublas" and "tflops" in row
    }
    shapes = sorted({key[:3] for key in latest})
    table = []
    for m, k, n in shapes:
        entries = {
            path: {
                "tflops": round(r["tflops"], 1),
                "x_bf16": round(r["tflops"] / bf16[(r["run"], m, k, n)], 3),
                "run": r["run"],
                "x_bf16_each_run": {
                    f"run{i + 1}": round(t / bf16[(i, m, k, n)], 3)
                    for i, t in r["all_runs"]  # type: ignore[union-attr]
                },
            }
            for (mm, kk, nn, path), r in latest.items()
            if (mm, kk, nn) == (m, k, n)
        }
        goals = {}
        for scheme, goal in GOALS.items():
            ours = {p: e for p, e in entries.items() if shipped.get(p) == scheme}
            best = max(ours.items(), key=lambda item: item[1]["x_bf16"])
            goals[scheme] = {"goal_x_bf16": goal, "best_path": best[0], "x_bf16": best[1]["x_bf16"],
                             "met": best[1]["x_bf16"] >= goal}  # fmt: skip
        table.append({"M": m, "K": k, "N": n, "paths": entries, "goals": goals})
    return {"shapes": table, "excluded": exclude}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        metavar="RUN",
        help="only summarize these runs' JSON (latest row wins)",
    )
    parser.add_argument(
        "--exclude",
        nargs="*",
        default=[],
        metavar="PATH@M,K,N=WHY",
        help="with --merge: invalid measurements",
    )
    parser.add_argument("--no-torchao", action="store_true", help="skip the torchao rows")
    parser.add_argument(
        "--shapes", choices=tuple(SHAPE_SETS), default="seed", help="the M x (K, N) set timed"
    )
    parser.add_argument(
        "--schemes", default="", help="comma list: only these schemes' ditq paths (default: all)"
    )
    parser.add_argument(
        "--only", default="", help="comma list: time only rows whose name contains one (and bf16)"
    )
    args = parser.parse_args()
    if args.merge:
        runs = [json.loads(path.read_text()) for path in args.merge]
        exclude = dict(item.split("=", 1) for item in args.exclude)
        merged = {
            "command": "python " + " ".join(sys.argv),
            "runs": runs,
            "summary": summarize(runs, exclude),
        }
        args.out.write_text(json.dumps(merged, indent=1))
        return 0
    env = _environment()
    only = [part for part in args.only.split(",") if part] + (["bf16-cublas"] if args.only else [])
    torchao_ok = not args.no_torchao and not str(env["torchao"]).startswith("unavailable")
    print(json.dumps(env), flush=True)
    rows: list[dict[str, object]] = []
    started = time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shapes_m, shapes_kn = SHAPE_SETS[args.shapes]
    schemes = [name for name in args.schemes.split(",") if name]
    for m in shapes_m:
        for k, n in shapes_kn:
            rows.extend(_rows_for_shape(m, k, n, torchao_ok, only, schemes))
            print(f"done M={m} K={k} N={n} at {time.time() - started:.0f}s", flush=True)
            result = {  # rewritten after every shape, so a cut-short run still leaves its numbers
                "command": "python " + " ".join(sys.argv),
                "environment": env,
                "timing": "median ms of triton.testing.do_bench(warmup=25ms, rep=100ms); input x bf16 (M, K) random",
                "rel_l2_vs_bf16": "output vs BF16 cuBLAS F.linear on the unquantized weight (quantization error included)",
                "rows": rows,
                "triton_autotune_choice": _triton_best_configs(),
                "four_bit": four_bit_ratios(rows),
            }
            args.out.write_text(json.dumps(result, indent=1))
    print(_table(rows))
    for line in four_bit_ratios(rows):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
