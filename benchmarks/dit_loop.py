"""Qwen-Image-2.1's denoising loop as the pipeline runs it, for ``dit_bench.py``.

The loop is diffusers' own: ``QwenImage21Pipeline.__call__`` runs unchanged -- its timesteps, its
``QwenImage21KVCache``, the ``"extract"`` first step (text + reference tokens prefilled into the cache) and
the ``"cached"`` later steps (only the target image's tokens recomputed), the same transformer kwargs, the
scheduler step. Only the two methods that need the text encoder and the VAE are replaced
(``PrecomputedInputsPipeline``): ``encode_prompt`` returns random prompt embeddings with the image-slot
mask a Qwen3-VL prompt with ``references`` images has, and ``prepare_latents`` returns random target and
reference latents. Each step is timed from the end of the previous one (the first from the transformer's
first call) to the end of the pipeline's ``callback_on_step_end``, with the device synchronized at both
marks, so a step holds the transformer call, the scheduler step and the loop's own bookkeeping.
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
from PIL import Image

from ditq.numerics import relative_l2

__all__ = [
    "TEXT_BEFORE_EACH_REFERENCE",
    "LoopCase",
    "LoopTiming",
    "PrecomputedInputsPipeline",
    "layer_errors",
    "loop_pipeline",
    "make_case",
    "profile_loop",
    "run_loop",
    "time_loop",
]

# Prompt tokens ahead of each reference's image slots ("<imageN><|vision_start|>" and separators in the
# pipeline's template); the rest of the prompt follows the last reference, so the prefill's text segments
# interleave with the references as in a real prompt.
TEXT_BEFORE_EACH_REFERENCE = 6
LATENT_TOKENS_PER_SLOT = 4  # one vision-language image slot per 2x2 latent tokens
PIXELS_PER_LATENT_TOKEN = 16  # QwenImage21Pipeline.vae_scale_factor


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class LoopCase:
    """What the text encoder and the VAE would hand the denoising loop for one prompt with ``references`` images."""

    references: int
    text_tokens: int
    grid: int  # latent tokens a side of each image (target and references alike)
    prompt_embeds: (
        torch.Tensor
    )  # (1, vlm_tokens, context_in_dim): text tokens and the references' image slots
    image_pad_mask: torch.Tensor  # (1, vlm_tokens) bool, True at the references' image slots
    latents: torch.Tensor  # (1, grid * grid, in_channels): the target's starting noise
    reference_latents: (
        torch.Tensor | None
    )  # (1, references * grid * grid, in_channels); None without references

    @property
    def side_px(self) -> int:
        return self.grid * PIXELS_PER_LATENT_TOKEN

    @property
    def joint_tokens(self) -> int:
        """Tokens of the transformer's joint sequence at the prefix step: text + every image's latent tokens."""
        return self.text_tokens + (self.references + 1) * self.grid * self.grid


def make_case(
    config: dict[str, Any], text: int, grid: int, references: int, device: torch.device, seed: int = 1
) -> LoopCase:
    """Seeded normal inputs (the same for every variant) at ``text`` prompt tokens and ``grid`` x ``grid`` latents."""
    in_channels = config.get("in_channels", 64)
    context = config.get("context_in_dim", 4096)
    slots = grid * grid // LATENT_TOKENS_PER_SLOT
    if text < TEXT_BEFORE_EACH_REFERENCE * references:
        raise ValueError(
            f"{text} text tokens cannot sit {TEXT_BEFORE_EACH_REFERENCE} before each of {references}"
        )
    pieces = []
    for _ in range(references):
        pieces += [
            torch.zeros(TEXT_BEFORE_EACH_REFERENCE, dtype=torch.bool),
            torch.ones(slots, dtype=torch.bool),
        ]
    pieces.append(torch.zeros(text - TEXT_BEFORE_EACH_REFERENCE * references, dtype=torch.bool))
    image_pad_mask = torch.cat(pieces)[None].to(device)
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device).to(torch.bfloat16)

    return LoopCase(
        references=references,
        text_tokens=text,
        grid=grid,
        prompt_embeds=normal(1, image_pad_mask.shape[1], context),
        image_pad_mask=image_pad_mask,
        latents=normal(1, grid * grid, in_channels),
        reference_latents=normal(1, references * grid * grid, in_channels) if references else None,
    )


class PrecomputedInputsPipeline(QwenImage21Pipeline):
    """``QwenImage21Pipeline`` whose prompt encoding and latent preparation return ``self.case``'s tensors.

    Everything else, the denoising loop included, is the installed diffusers' code.
    """

    case: LoopCase

    def encode_prompt(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None, torch.Tensor]:
        # An unpadded batch of one: the pipeline's own encode_prompt returns None for an all-True mask.
        return self.case.prompt_embeds, None, self.case.image_pad_mask

    def prepare_latents(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.case.latents.clone(), self.case.reference_latents


def loop_pipeline(transformer: torch.nn.Module, processor: Any, scheduler_config: dict[str, Any]) -> Any:
    """The ``PrecomputedInputsPipeline`` around ``transformer`` (no text encoder, no VAE).

    ``processor`` is only read by the pipeline's __init__ (the chat template's token counts); any Qwen3-VL processor does.
    """
    pipe: Any = PrecomputedInputsPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler_config),
        vae=None,
        text_encoder=None,
        processor=processor,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_loop(pipe: Any, case: LoopCase, steps: int) -> tuple[list[float], torch.Tensor]:
    """(ms of each of ``steps`` denoising steps, the final packed latents) of one ``pipe(...)`` call on ``case``."""
    device = case.latents.device
    marks: list[float] = []

    def first_call(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not marks:
            _sync(device)
            marks.append(time.perf_counter())

    def step_end(pipeline: Any, index: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        _sync(device)
        marks.append(time.perf_counter())
        return {}

    pipe.case = case
    # The pipeline reads the references' count and sizes from these; their pixels go only to the replaced methods.
    images = [Image.new("RGB", (case.side_px, case.side_px)) for _ in range(case.references)] or None
    handle = pipe.transformer.register_forward_pre_hook(first_call, with_kwargs=True)
    try:
        latents = pipe(
            prompt_embeds=case.prompt_embeds,
            image=images,
            height=case.side_px,
            width=case.side_px,
            output_resolution=case.side_px,
            num_inference_steps=steps,
            output_type="latent",
            return_dict=False,
            callback_on_step_end=step_end,
        )[0]
    finally:
        handle.remove()
    if len(marks) != steps + 1:
        raise RuntimeError(f"timed {len(marks) - 1} steps of {steps}: the pipeline's loop changed")
    return [(b - a) * 1000 for a, b in itertools.pairwise(marks)], latents


@dataclass(frozen=True)
class LoopTiming:
    prefix_step_ms: float  # the first ("extract") step, median over repeats
    cached_step_ms: float  # the later ("cached") steps, median over all of them
    loop_ms: float  # one whole loop, median over repeats
    cached_steps_ms: list[float]  # every cached step of every repeat, in order
    warmup_seconds: float  # the untimed warm-up loop (first step + one cached step), compilation included
    peak_bytes: int  # device memory peak over the timed loops, above what was held before them
    latents: torch.Tensor  # the last timed loop's final latents


def time_loop(pipe: Any, case: LoopCase, steps: int, repeats: int) -> LoopTiming:
    """A warm-up loop of 2 steps (both graphs of a compiled model built), then ``repeats`` timed loops of ``steps``."""
    device = case.latents.device
    start = time.perf_counter()
    run_loop(pipe, case, 2)
    _sync(device)
    warmup = time.perf_counter() - start
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    prefix, cached, totals = [], [], []
    for _ in range(repeats):
        step_ms, latents = run_loop(pipe, case, steps)
        prefix.append(step_ms[0])
        cached += step_ms[1:]
        totals.append(sum(step_ms))
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
    return LoopTiming(
        prefix_step_ms=statistics.median(prefix),
        cached_step_ms=statistics.median(cached) if cached else math.nan,
        loop_ms=statistics.median(totals),
        cached_steps_ms=cached,
        warmup_seconds=warmup,
        peak_bytes=int(peak),
        latents=latents,
    )


def _fused_members(model: torch.nn.Module) -> dict[str, tuple[str, int, int]]:
    """Member Linear's name -> (the fused Linear computing it, first output column, width)
    (``ditq.runtime.models.qwenimage21.fuse``)."""
    found: dict[str, tuple[str, int, int]] = {}
    for name, module in model.named_modules():
        parent, start = name.rpartition(".")[0], 0
        for member, width in getattr(module, "fused_members", ()):
            found[f"{parent}.{member}" if parent else member] = (name, start, width)
            start += width
    return found


def layer_errors(pipe: Any, case: LoopCase, reference: torch.nn.Module, names: list[str]) -> dict[str, Any]:
    """Each named Linear's output against ``reference``'s BF16 Linear of that name on the same captured input
    (a Linear fused with its siblings: its columns of the fused output).

    Captured on the loop's first (prefix) step of ``case``: every token of the joint sequence goes through it.
    """
    errors: dict[str, float] = {}
    fused = _fused_members(pipe.transformer)
    # module name -> [(member name, first column, width)]: the outputs each hooked module is compared on
    pieces: dict[str, list[tuple[str, int, int | None]]] = {}
    for name in names:
        module, start, width = fused.get(name, (name, 0, None))
        pieces.setdefault(module, []).append((name, start, width))

    def hook(compared: list[tuple[str, int, int | None]]) -> Any:
        def compare(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            for name, start, width in compared:
                linear = reference.get_submodule(name)
                assert isinstance(linear, torch.nn.Linear), (
                    f"{name}: {type(linear).__name__} in the BF16 model"
                )
                if name not in errors:  # the first call: the prefix step
                    expected = torch.nn.functional.linear(args[0], linear.weight, linear.bias)
                    ours = output if width is None else output[..., start : start + width]
                    errors[name] = relative_l2(ours, expected)

        return compare

    handles = [
        pipe.transformer.get_submodule(module).register_forward_hook(hook(compared))
        for module, compared in pieces.items()
    ]
    try:
        run_loop(
            pipe, case, 2
        )  # one step would be a one-sigma schedule, which the scheduler's terminal stretch
        # divides by zero on
    finally:
        for handle in handles:
            handle.remove()
    values = sorted(errors.values())
    worst = sorted(errors.items(), key=lambda item: item[1], reverse=True)[:5]
    return {
        "captured_on": f"the prefix step at {case.references} references ({case.joint_tokens} tokens)",
        "layers": len(errors),
        "median": round(statistics.median(values), 5),
        "max": round(values[-1], 5),
        "worst_5": [[name, round(value, 5)] for name, value in worst],
    }


# Device kernels by what they compute, first match wins (kernel names: cuBLAS/cuDNN/CUTLASS, PyTorch's flash and
# memory-efficient attention, inductor's generated Triton (triton_poi/red/per_*, triton_tem_* for its GEMM
# templates), ditq's own Triton kernels).
KERNEL_CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # inductor's fused kernels first: it names them after every op they hold, the next GEMM op's too
    ("compiled fused elementwise/norm (+ activation quantization)", re.compile(r"^triton_(poi|red|per)_")),
    ("attention", re.compile(r"flash|fmha|attn|attention|sdpa|_quantize_rows_kernel", re.IGNORECASE)),
    ("activation quantization", re.compile(r"act_quant", re.IGNORECASE)),
    ("weight dequantization", re.compile(r"_dequant_kernel")),
    (
        "gemm",
        re.compile(
            r"gemm|matmul|nvjet|xmma|cutlass|wgmma|f8f8bf16|triton_tem_|_w8a8_|_w8a16_", re.IGNORECASE
        ),
    ),
)
OTHER = "other (eager elementwise, norms, copies, RoPE)"


def kernel_category(name: str) -> str:
    return next((label for label, pattern in KERNEL_CATEGORIES if pattern.search(name)), OTHER)


def profile_loop(pipe: Any, case: LoopCase, steps: int) -> dict[str, Any]:
    """Where one loop's device time goes: a loop of ``steps`` (one prefix step, the rest cached) under
    torch.profiler, its kernels' device time summed by ``KERNEL_CATEGORIES``, the busiest kernels, and the wall
    time against the device's busy time (the rest: launch gaps and host work)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if case.latents.device.type == "cuda" else []
    )
    with profile(activities=activities) as prof:
        step_ms, _ = run_loop(pipe, case, steps)
    kernels: dict[str, tuple[float, int]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        total, count = kernels.get(event.name, (0.0, 0))
        kernels[event.name] = (total + event.time_range.elapsed_us() / 1000.0, count + 1)
    by_category: dict[str, float] = {}
    for name, (ms, _) in kernels.items():
        category = kernel_category(name)
        by_category[category] = by_category.get(category, 0.0) + ms
    busy = sum(by_category.values())
    wall = sum(step_ms)
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:12]
    return {
        "steps": steps,
        "wall_ms": round(wall, 2),
        "device_busy_ms": round(busy, 2),
        "device_idle_share": None if not wall or not busy else round(max(0.0, 1 - busy / wall), 3),
        "by_category_ms": {k: round(v, 2) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
        "by_category_share": {k: round(v / busy, 3) for k, v in by_category.items()} if busy else {},
        "top_kernels": [
            {"name": name[:160], "category": kernel_category(name), "ms": round(ms, 2), "calls": calls}
            for name, (ms, calls) in top
        ],
    }
