"""benchmarks/dit_bench.py: its denoising loop is the pipeline's, and its tiny CPU dry run fills every row."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline, QwenImage21Transformer2DModel

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
sys.path.insert(0, str(BENCHMARKS.parent / "tools"))

import dit_loop  # noqa: E402
import full_size_pipeline  # noqa: E402

TINY = dict(
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    context_in_dim=64,
    in_channels=64,
    out_channels=64,
    axes_dims_rope=(8, 12, 12),
)


def test_loop_without_references_is_the_stock_pipeline() -> None:
    """At 0 references the stock pipeline takes embeddings and latents itself: the bench's loop gives its latents."""
    torch.manual_seed(0)
    transformer = torch.nn.Module.to(QwenImage21Transformer2DModel.from_config(TINY), torch.bfloat16).eval()
    processor = full_size_pipeline.build_processor(full_size_pipeline.PRESETS["tiny"])
    case = dit_loop.make_case(TINY, 32, 8, 0, torch.device("cpu"))
    pipe = dit_loop.loop_pipeline(transformer, processor, full_size_pipeline.SCHEDULER_CONFIG)
    step_ms, ours = dit_loop.run_loop(pipe, case, 4)
    stock: Any = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**full_size_pipeline.SCHEDULER_CONFIG),
        vae=None,
        text_encoder=None,
        processor=processor,
        transformer=transformer,
    )
    stock.set_progress_bar_config(disable=True)
    expected = stock(
        prompt_embeds=case.prompt_embeds,
        latents=case.latents,
        height=case.side_px,
        width=case.side_px,
        num_inference_steps=4,
        output_type="latent",
        return_dict=False,
    )[0]
    assert len(step_ms) == 4 and all(ms > 0 for ms in step_ms)
    assert torch.equal(ours, expected)


def test_case_layout_interleaves_text_and_reference_slots() -> None:
    case = dit_loop.make_case(TINY, 32, 8, 2, torch.device("cpu"))
    mask = case.image_pad_mask[0].tolist()
    slots = 8 * 8 // 4
    before = dit_loop.TEXT_BEFORE_EACH_REFERENCE
    assert mask == ([False] * before + [True] * slots) * 2 + [False] * (32 - 2 * before)
    assert case.reference_latents is not None and case.reference_latents.shape == (1, 2 * 64, 64)
    assert case.joint_tokens == 32 + 3 * 64


@pytest.mark.slow
def test_tiny_dry_run_fills_every_loop_row(tmp_path: Path) -> None:
    out = tmp_path / "dit_bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the tiny model's timings are noise either way
    command = [
        sys.executable,
        str(BENCHMARKS / "dit_bench.py"),
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--loop-steps",
        "2",  # every row filled is the point here, not its timing
        # compiled as ditq serve compiles (one prefix graph for every reference count): 46 s where the default's
        # graph per reference count took 60 s
        "--compile-shapes",
        "served",
    ]
    subprocess.run([*command, "--out", str(out)], check=True, env=env, timeout=600)
    result = json.loads(out.read_text())
    assert result["finished"] is True  # every step was planned, run or listed; a killed run's file says false
    # where torchao imports on a CPU, its float8 config refuses the device (it needs CUDA sm_89+): an error, recorded
    assert [name for name in result.get("errors", {}) if not name.startswith("torchao-")] == []
    rows = {(r["variant"], r["mode"], r["references"]): r for r in result["rows"]}
    for variant in ("bf16", "w8a8", "fp8", "w8a16"):
        for mode in ("eager", "compiled"):
            for references in (0, 1, 2, 3, 4):
                row = rows[(variant, mode, references)]
                for field in ("prefix_step_ms", "cached_step_ms", "loop_ms"):
                    assert math.isfinite(row[field]) and row[field] > 0, (variant, mode, references, field)
                    ratio = row[f"{field.removesuffix('_ms')}_vs_bf16_same_mode"]
                    assert ratio is not None and math.isfinite(ratio)
                assert len(row["cached_steps_ms"]) == result["loop"]["cached_steps"] == 2
                # tiny default-init model: 8-bit Linears move the final latents by well under 5 %
                assert row["final_latents_rel_l2_vs_bf16_eager"] < 0.05
                if mode == "compiled":
                    assert row["graph_breaks"] == 0
    assert rows[("bf16", "eager", 4)]["loop_vs_bf16_same_mode"] == 1.0
    # 4-bit: compiled at both ends without a graph break, every target through the CPU reference path
    for references in (0, 4):
        row = rows[("w4a8", "compiled", references)]
        assert row["loop_ms"] > 0 and row["graph_breaks"] == 0
        assert row["final_latents_rel_l2_vs_bf16_eager"] < 0.2
        assert set(row["kernels"]) == {"cpu-reference-w4a8"}
    # quantized attention over the quantized models, through the path the doctor chose (the CPU reference here)
    for variant, kind in (("fp8+attn-int8-fp8", "int8-fp8"), ("w8a8+attn-int8", "int8")):
        for mode in ("eager", "compiled"):
            for references in (0, 4):
                row = rows[(variant, mode, references)]
                assert row["attention_path"] == f"cpu-reference-attention-{kind}"
                assert row["loop_ms"] > 0 and row["final_latents_rel_l2_vs_bf16_eager"] < 0.05
    # the quantized variants run their projections apart, as served; the fused ones show what the fusion gives
    fused_kernels = rows[("fp8-fused", "eager", 0)]["kernels"]
    assert sum(fused_kernels.values()) < sum(rows[("fp8", "eager", 0)]["kernels"].values())
    for variant in ("w8a8-fused", "fp8-fused"):
        for mode in ("eager", "compiled"):
            for references in (0, 4):
                row = rows[(variant, mode, references)]
                assert row["loop_ms"] > 0 and row["final_latents_rel_l2_vs_bf16_eager"] < 0.05
        scheme = variant.removesuffix("-fused")
        assert set(result["summary"][f"{scheme}_fused_compiled_loop_vs_unfused"]) == {"r0", "r4"}
    assert "bf16+sdpa-cudnn: cuDNN attention needs CUDA" in result["skipped"]
    assert not any("profile" in row for row in rows.values())
    # --profile (a run of its own, on one variant: the profiler took a third of the whole run's time): the rows at 0
    # and 4 references carry one profiled 3-step loop (no device kernels on a CPU), the others none
    profiled = tmp_path / "dit_bench_profiled.json"
    subprocess.run([*command, "--variants", "bf16", "--profile", "--out", str(profiled)], check=True, env=env,
                   timeout=600)  # fmt: skip
    profiled_rows = json.loads(profiled.read_text())["rows"]
    assert {(r["variant"], r["mode"]) for r in profiled_rows} == {("bf16", "eager"), ("bf16", "compiled")}
    for row in profiled_rows:
        where = (row["mode"], row["references"])
        if row["references"] in (0, 4):
            assert row["profile"]["steps"] == 3 and row["profile"]["wall_ms"] > 0, where
        else:
            assert "profile" not in row, where
    for scheme in ("w8a8", "fp8", "w8a16"):
        errors = result["layer_errors"][scheme]
        assert errors["layers"] == result["model"]["quantized_linears"]
        assert 0 < errors["median"] <= errors["max"] < 0.1 and len(errors["worst_5"]) == 5
    for variant in ("torchao-int8dyn", "torchao-fp8row"):
        if variant in result["unavailable"]:
            assert result["unavailable"][variant].startswith("unavailable: ")
        elif f"{variant} quantize" not in result.get("errors", {}):
            assert rows[(variant, "compiled", 0)]["loop_ms"] > 0
    assert set(result["summary"]["w8a8_eager_loop_vs_bf16_eager"]["by_references"]) == {
        "r0",
        "r1",
        "r2",
        "r3",
        "r4",
    }


def test_kernel_categories_name_what_each_kernel_computes() -> None:
    assert dit_loop.kernel_category("_w8a8_persistent_kernel") == "gemm"
    assert dit_loop.kernel_category("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNN") == "gemm"
    assert dit_loop.kernel_category("void cutlass::device_kernel<f8f8bf16_rowwise>") == "gemm"
    assert dit_loop.kernel_category("triton_tem_fused_mm_0") == "gemm"
    assert dit_loop.kernel_category("void pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert dit_loop.kernel_category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert dit_loop.kernel_category("_attention_kernel") == "attention"
    assert dit_loop.kernel_category("_quantize_rows_kernel") == "attention"  # Q/K quantization for attention
    assert dit_loop.kernel_category("_act_quant_kernel") == "activation quantization"
    assert dit_loop.kernel_category("_dequant_kernel") == "weight dequantization"
    fused = "compiled fused elementwise/norm (+ activation quantization)"
    assert dit_loop.kernel_category("triton_red_fused_native_layer_norm_0") == fused
    # inductor names a fused producer + quantization after the GEMM op that follows it: still not a GEMM
    assert (
        dit_loop.kernel_category("triton_red_fused_abs_amax_clamp_div_round_w8a8_triton_persistent_7")
        == fused
    )
    assert dit_loop.kernel_category("triton_red_fused__scaled_mm__to_copy_abs_amax_clamp_div_8") == fused
    assert (
        dit_loop.kernel_category("void at::native::vectorized_elementwise_kernel<4, ...>") == dit_loop.OTHER
    )


def test_served_compile_shapes_compile_the_blocks_as_ditq_serve_does() -> None:
    """--compile-shapes served: the compiled rows' blocks call through ditq serve's compilation (compile_blocks:
    dynamic shapes, slices as index tensors), and eager rows through none; what that compilation does is tested
    on the tiny Qwen-Image-2.1 (tests/tools/test_full_size_pipeline.py)."""
    import dit_bench

    from ditq.runtime.compile import _call_compiled

    transformer = QwenImage21Transformer2DModel.from_config(TINY)
    compilation = dit_bench.RegionalCompilation("eager", served=True)
    compilation.set_mode(transformer, "compiled", fullgraph=True)
    calls = [block._compiled_call_impl for block in transformer.transformer_blocks]
    assert all(isinstance(call, functools.partial) and call.func is _call_compiled for call in calls)
    compilation.set_mode(transformer, "eager", fullgraph=True)
    assert all(block._compiled_call_impl is None for block in transformer.transformer_blocks)
    compilation.set_mode(transformer, "compiled", fullgraph=True)  # switching back reuses the same wrappers
    assert [block._compiled_call_impl for block in transformer.transformer_blocks] == calls
