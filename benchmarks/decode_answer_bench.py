"""A request's fixed costs after the denoising loop, before and after, in one process: the VAE decode and the answer.

    python3 benchmarks/decode_answer_bench.py --model MODEL --out FILE [--size 1024x1024] [--repeats 10]

Decode: the model's own VAE (BF16, on the GPU) decodes seeded latents of the size asked, as the pipeline calls it, in
four forms, each on its own copy of the weights: untouched (diffusers' eager decode, what ditq served before),
channels-last (the decoder's weights only), compiled-channels-last (both), and served
(``ditq.runtime.compile.compile_vae_decoder``: compiled with dynamic shapes, as ``--compile`` serves). Per form:
the first call (the compilation), the median wall time of the calls after it (device synchronised), the pixel
difference from the untouched decode (0..255 levels, rounded as the pipeline rounds), and the graphs a second size
(``--second-size``) compiled (0: one graph serves every size).

Answer: from the untouched decode's output, what the server does before its JSON goes out, part by part: the
pipeline's postprocess to PIL images (before: diffusers' own, float32 on the host; after:
``ditq.runtime.postprocess``, 8-bit pixels made on the device), the collapse check, the PNG, base64. Medians of
``--repeats`` runs; the pixels of both postprocesses are compared.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import diffusers
from diffusers.image_processor import VaeImageProcessor

from ditq.fsutil import atomic_write_json
from ditq.runtime.compile import compile_vae_decoder, compiled_graphs
from ditq.runtime.images import checked_and_encoded, collapse_reasons, encode_image
from ditq.runtime.postprocess import pixels_on_device
from ditq.signatures import load_rules


def load_vae(model: Path, device: torch.device) -> torch.nn.Module:
    """The model's VAE, its class as ``model_index.json`` names it, in BF16 on ``device``."""
    _library, class_name = json.loads((model / "model_index.json").read_text())["vae"]
    vae = getattr(diffusers, class_name).from_pretrained(model / "vae", torch_dtype=torch.bfloat16)
    return vae.to(device).eval()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_ms(call: Callable[[], Any]) -> tuple[float, Any]:
    _sync()
    start = time.perf_counter()
    out = call()
    _sync()
    return (time.perf_counter() - start) * 1e3, out


def _levels(decoded: torch.Tensor) -> torch.Tensor:
    return ((decoded[:, :, 0].float() / 2 + 0.5).clamp(0, 1) * 255).round()


def _channels_last(vae: torch.nn.Module) -> None:
    vae.decoder.to(memory_format=torch.channels_last)


def _compiled_channels_last(vae: torch.nn.Module) -> None:
    _channels_last(vae)
    compile_vae_decoder(vae, "inductor")


FORMS: dict[str, Callable[[torch.nn.Module], object] | None] = {
    "untouched": None,
    "channels-last": _channels_last,
    "compiled-channels-last": _compiled_channels_last,
    "served": lambda vae: compile_vae_decoder(vae, "inductor"),
}


def decode_rows(
    vae: torch.nn.Module, latents: torch.Tensor, second: torch.Tensor, repeats: int, forms: list[str]
) -> list[dict]:
    rows, reference = [], None
    for name in forms:
        prepare = FORMS[name]
        form = copy.deepcopy(vae)
        if prepare is not None:
            prepare(form)
        with torch.inference_mode():
            first_ms, out = _timed_ms(lambda form=form: form.decode(latents).sample)
            times = [_timed_ms(lambda form=form: form.decode(latents).sample)[0] for _ in range(repeats)]
            graphs = compiled_graphs()
            form.decode(second)
            graphs_second = compiled_graphs() - graphs
        levels = _levels(out)
        reference = levels if reference is None else reference
        difference = (levels - reference).abs()
        rows.append({
            "form": name, "first_call_ms": round(first_ms, 1), "decode_ms": round(statistics.median(times), 2),
            "decode_ms_min": round(min(times), 2), "pixel_diff_max": difference.max().item(),
            "pixel_diff_mean": round(difference.mean().item(), 5), "graphs_at_second_size": graphs_second,
        })  # fmt: skip
        print(f"decode {name:14s} {rows[-1]['decode_ms']:8.2f} ms (first call {first_ms:.0f} ms), pixels vs "
              f"untouched: max {rows[-1]['pixel_diff_max']:.0f}, mean {rows[-1]['pixel_diff_mean']:.5f}", flush=True)  # fmt: skip
        del form
    return rows


def answer_rows(decoded: torch.Tensor, repeats: int) -> tuple[list[dict], bool]:
    """The answer's parts, before (diffusers' postprocess) and after (pixels made on the device)."""
    processor, rules, image = VaeImageProcessor(vae_scale_factor=16), load_rules(), decoded[:, :, 0]
    pipeline = SimpleNamespace(image_processor=processor)
    made: dict[str, Any] = {}
    rows = []
    for name in ("before", "after"):
        parts: dict[str, list[float]] = {
            "postprocess": [], "collapse_check": [], "png": [], "base64": [], "check_beside_png": [],
        }  # fmt: skip
        for _ in range(repeats + 1):  # the first: a warm-up
            if name == "after":
                with pixels_on_device(pipeline):
                    ms, pil = _timed_ms(lambda: processor.postprocess(image, output_type="pil")[0])
            else:
                ms, pil = _timed_ms(lambda: processor.postprocess(image, output_type="pil")[0])
            parts["postprocess"].append(ms)
            parts["collapse_check"].append(_timed_ms(lambda pil=pil: collapse_reasons(pil, rules))[0])
            ms, data = _timed_ms(lambda pil=pil: encode_image(pil, "png", "auto"))
            parts["png"].append(ms)
            parts["base64"].append(_timed_ms(lambda data=data: base64.b64encode(data))[0])
            # what the server runs: the check on a thread of its own beside the PNG (not counted in total_ms)
            ms, _ = _timed_ms(lambda pil=pil: checked_and_encoded([pil], rules, "png", "auto"))
            parts["check_beside_png"].append(ms)
        made[name] = pil
        medians = {part: round(statistics.median(times[1:]), 2) for part, times in parts.items()}
        rows.append({"postprocess": name, **{f"{part}_ms": ms for part, ms in medians.items()},
                     "total_ms": round(sum(medians.values()) - medians["check_beside_png"], 2),
                     "served_total_ms": round(medians["postprocess"] + medians["check_beside_png"]
                                              + medians["base64"], 2)})  # fmt: skip
        print(f"answer {name:6s} " + ", ".join(f"{k} {v}" for k, v in rows[-1].items() if k != "postprocess"))
    import numpy as np

    return rows, bool(np.array_equal(np.asarray(made["before"]), np.asarray(made["after"])))


def _size(text: str) -> tuple[int, int]:
    width, height = (int(v) for v in text.lower().split("x"))
    return width, height


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a diffusers pipeline folder with a vae/")
    parser.add_argument("--size", type=_size, default=(1024, 1024), help="WxH (default 1024x1024)")
    parser.add_argument(
        "--second-size", type=_size, default=(768, 1344), help="WxH of the recompilation check"
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--forms", default=",".join(FORMS), help="the decode forms, comma-separated, untouched first"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tree", default=None, help="the commit of the code that runs (recorded)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device(args.device)
    vae = load_vae(args.model, device)
    ratio, z_dim = 16, vae.config.z_dim  # Qwen-Image-2.1's VAE: 16x spatial compression

    def latents(size: tuple[int, int], seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        shape = (1, z_dim, 1, size[1] // ratio, size[0] // ratio)
        return torch.randn(shape, generator=generator).to(device, torch.bfloat16)

    main_latents = latents(args.size, 2301)
    decode = decode_rows(
        vae, main_latents, latents(args.second_size, 2302), args.repeats, args.forms.split(",")
    )
    with torch.inference_mode():
        decoded = vae.decode(main_latents).sample
    answer, same_pixels = answer_rows(decoded, args.repeats)
    payload = {
        "command": " ".join(["python3", *sys.argv]),
        "tree": args.tree,
        "environment": {
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "python": platform.python_version(),
        },
        "size": list(args.size),
        "decode": decode,
        "answer": answer,
        "answer_pixels_equal": same_pixels,
    }
    atomic_write_json(args.out, payload)
    print(f"postprocess pixels equal: {same_pixels}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
