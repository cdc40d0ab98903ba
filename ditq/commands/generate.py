"""`ditq generate`: one image from an artifact, a plain diffusers directory or the bundled demo model; an image
with a collapse signature (as ditq serve checks) is not written, and the command fails naming the signature."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

from ditq.checkpoint.hub import resolve_model
from ditq.commands import LOAD_FLAGS, add_load_arguments, load_options_from_args
from ditq.errors import DitqError
from ditq.pictures import open_picture

if TYPE_CHECKING:
    from ditq.pipeline.generate import GenerationReport

__all__ = ["add_arguments", "run"]

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        nargs="?",
        metavar="PATH",
        help="artifact or diffusers directory or hub id (org/name[@revision], through the hub cache) (default: the bundled demo model)",
    )
    parser.add_argument("--prompt", required=True, help="what to draw")
    parser.add_argument("--negative-prompt", help="what to avoid (pipelines that take one)")
    parser.add_argument(
        "--image",
        type=Path,
        nargs="+",
        action="extend",
        default=[],
        metavar="REF",
        help="reference image(s) for an edit",
    )
    parser.add_argument("--seed", type=int, help="random seed (0 is a seed)")
    parser.add_argument("--steps", type=int, help="denoising steps (default: the pipeline's)")
    parser.add_argument("--size", metavar="WxH", help="output size (default: the pipeline's)")
    parser.add_argument("--guidance", type=float, help="guidance / true CFG scale")
    parser.add_argument(
        "--out", type=Path, default=Path("ditq-generate.png"), metavar="FILE", help="PNG to write"
    )
    add_load_arguments(parser, flags=[f for f in LOAD_FLAGS if f not in ("max_memory", "skip_doctor")])
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH[:SCALE]",
        help="draw with a LoRA adapter (repeatable), as ditq serve --lora loads it: PATH a .safetensors file or a "
        "folder holding one (diffusers' or peft's format), SCALE its weight (default 1)",
    )
    parser.add_argument(
        "--on-collapse",
        choices=("error", "warn"),
        default="error",
        help="an image with a collapse signature (as ditq serve checks): fail without writing it (default), "
        "or write it with a warning",
    )
    add_load_arguments(parser, flags=["skip_doctor"])  # after --on-collapse, where --help has always shown it


def _open_references(paths: list[Path]) -> list[Image.Image]:
    images = []
    for path in paths:
        with open_picture(path) as image:  # PNG, JPEG or WebP by signature, pixels bounded (ditq.pictures)
            images.append(
                image.convert("RGBA") if image.mode in ("RGBA", "LA", "P") else image.convert("RGB")
            )
    return images


def _gib(value: int | None) -> str:
    return "n/a (CPU)" if value is None else f"{value / 2**30:.2f} GiB"


def _print_report(report: GenerationReport) -> None:
    quantized = "; ".join(
        f"{c}: " + ", ".join(f"{n} {s}" for s, n in sorted(per.items()))
        for c, per in report.quantized.items()
    )
    print(f"model      {report.model_dir}")
    print(f"quantized  {quantized or 'none (source precision)'}")
    if report.kernels:
        print("kernels    " + ", ".join(f"{name} x{count}" for name, count in sorted(report.kernels.items())))
    if report.attention:
        print(f"attention  {report.attention}")
    print(f"device     {report.device} (offload {report.offload})")
    if report.placement is not None:
        placement = report.placement
        tiling = "; VAE tiling" if placement["vae_tiling"] else ""
        rate = f"; {placement['transfer_gbps']} GB/s from pinned memory" if placement["transfer_gbps"] else ""
        print(
            f"placement  resident {', '.join(placement['resident']) or 'nothing'}; "
            f"streamed {', '.join(placement['streamed']) or 'nothing'}{tiling}{rate}"
        )
    for module, size in report.unused.items():
        print(f"unused     {module} ({size / 2**30:.2f} GiB) not loaded")
    print(
        f"load       {report.load_seconds:8.3f} s   peak accelerator memory {_gib(report.load_peak_memory_bytes)}"
    )
    if report.compile is not None:
        facts = report.compile
        print(
            f"compile    {facts['backend']}, {facts['how']}: warm-up {facts['warmup_seconds']:.3f} s "
            "(two steps at this shape, not in the times below)"
        )
    result = report.result
    for stage, seconds in result.timings.items():
        extra = ""
        if stage == "denoising" and result.step_times:
            extra = (
                f"   ({len(result.step_times)} steps, {1000 * seconds / len(result.step_times):.1f} ms/step)"
            )
        print(f"{stage:<10} {seconds:8.3f} s{extra}")
    if report.lora:
        print(
            "lora       "
            + ", ".join(
                f"{lora.name} x{lora.scale:g} ({lora.layers} layers, {lora.parameter_bytes} bytes)"
                for lora in report.lora
            )
        )
    if result.skipped_steps is not None:
        print(
            f"cache      {report.cache}: {result.skipped_steps} of {len(result.step_times)} steps from the cache"
        )
    print(f"peak       {_gib(result.peak_memory_bytes)}")
    if result.stage_peak_memory_bytes is not None:
        stages = ", ".join(f"{stage} {_gib(peak)}" for stage, peak in result.stage_peak_memory_bytes.items())
        print(f"by stage   {stages} (held at the start: {_gib(result.memory_at_start_bytes)})")


def _check_collapse(images: list[Image.Image], on_collapse: str) -> None:
    """The collapse signatures ditq serve checks (the gate's rules). With ``on_collapse`` "error" such an image
    is not written and the command fails with the signature and its measured values; "warn" writes it and says
    so."""
    from ditq.runtime.images import collapse_reasons
    from ditq.signatures import load_rules

    rules = load_rules()
    for index, image in enumerate(images):
        reasons = collapse_reasons(image, rules)
        if not reasons:
            continue
        detail = f"image {index + 1} of {len(images)}: {'; '.join(reasons)}"
        if on_collapse == "error":
            raise DitqError(f"the generated image is collapsed and was not written: {detail}")
        log.warning("the generated image is collapsed: %s", detail)


def run(args: argparse.Namespace) -> int:
    from ditq.pipeline.generate import generate, save_images
    from ditq.runtime.adapter import GenerationRequest, parse_size
    from ditq.runtime.lora_adapters import parse_lora_specs

    lora = parse_lora_specs(args.lora)
    width, height = parse_size(args.size, "--size") if args.size else (None, None)
    request = GenerationRequest(
        prompt=args.prompt,
        negative_prompt=args.negative_prompt,
        images=_open_references(args.image),
        width=width,
        height=height,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        seed=args.seed,
    )
    options = load_options_from_args(args)  # before the model is looked up: a bad option is one line
    model = None if args.path is None else resolve_model(args.path, args.variant)
    report = generate(model, request, options, lora=lora)
    _print_report(report)
    _check_collapse(report.result.images, args.on_collapse)
    for path in save_images(report.result.images, args.out):
        print(f"wrote      {path}")
    return 0
