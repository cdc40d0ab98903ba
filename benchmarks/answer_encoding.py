"""What a served answer costs the server's CPU after the pipeline: the PNG encoding and the JSON body, old and new.

    python benchmarks/answer_encoding.py --out benchmarks/results/answer_encoding_cpu_COMMIT.json

For a 1024x1024 RGBA image of noise (what random weights draw; it does not compress) and a smooth one (a gradient
with mild noise, as pictures compress): PIL's PNG writer at zlib level 1 (what ``ditq serve`` used before) against
ditq's own (``ditq.runtime.png``), each checked to decode to the same pixels; then the answer's JSON through
starlette's ``JSONResponse`` (before) against ``ImageResponse.json_bytes`` (now), each checked to parse to the same
object. Best of ``--repeats`` wall times in one process, in milliseconds, with the CPU count the writer's threads
could use.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image
from starlette.responses import JSONResponse

from ditq.fsutil import atomic_write_json
from ditq.runtime.png import encode_png
from ditq.serve.schemas import ImageData, ImageResponse, ImageUsage, StageMetrics

SIDE = 1024


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # the first call pays imports and thread starts
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(min(times) * 1000, 2)


def pil_png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def images() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (SIDE, SIDE, 4), dtype=np.uint8)
    ramp = np.linspace(0, 255, SIDE)[None, :, None] + np.linspace(0, 64, SIDE)[:, None, None]
    smooth = np.clip(ramp + rng.normal(0, 2, (SIDE, SIDE, 4)), 0, 255).astype(np.uint8)
    smooth[..., 3] = 255
    return {"noise": noise, "smooth": smooth}


def response_for(png: bytes) -> ImageResponse:
    return ImageResponse(
        created=0,
        data=[ImageData(b64_json=base64.b64encode(png).decode("ascii"))],
        output_format="png",
        size=f"{SIDE}x{SIDE}",
        background="auto",
        usage=ImageUsage(input_images=0, output_images=1, output_pixels=SIDE * SIDE),
        metrics=StageMetrics(
            queue_wait_ms=0.1,
            text_encoding_ms=80.0,
            denoising_ms=900.0,
            denoise_step_latency_ms=90.0,
            decoding_ms=110.0,
            postprocess_time_ms=100.0,
            generation_ms=1100.0,
            peak_memory_mb=None,
            num_inference_steps=10,
            image_pixels=SIDE * SIDE,
        ),
    )


def measure(name: str, pixels: np.ndarray, repeats: int) -> dict[str, object]:
    ours, theirs = encode_png(pixels), pil_png(pixels)
    for data in (ours, theirs):
        if not np.array_equal(np.asarray(Image.open(io.BytesIO(data))), pixels):
            raise SystemExit(f"{name}: a PNG does not decode to the image's pixels")
    response = response_for(ours)
    before = bytes(JSONResponse(response.model_dump(exclude_none=True)).body)
    if json.loads(response.json_bytes()) != json.loads(before):
        raise SystemExit(f"{name}: the two JSON bodies differ")
    row: dict[str, object] = {
        "image": name,
        "pil_level1_ms": best_ms(lambda: pil_png(pixels), repeats),
        "ditq_ms": best_ms(lambda: encode_png(pixels), repeats),
        "pil_level1_bytes": len(theirs),
        "ditq_bytes": len(ours),
        "json_body_mb": round(len(before) / 1e6, 2),
        "jsonresponse_ms": best_ms(lambda: JSONResponse(response.model_dump(exclude_none=True)), repeats),
        "json_bytes_ms": best_ms(response.json_bytes, repeats),
    }
    print(json.dumps(row))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = [measure(name, pixels, args.repeats) for name, pixels in images().items()]
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    result = {
        "command": "python benchmarks/answer_encoding.py --out benchmarks/results/answer_encoding_cpu_COMMIT.json",
        "cpu": platform.processor() or platform.machine(),
        "cpus": cpus,
        "side": SIDE,
        "repeats": args.repeats,
        "rows": rows,
    }
    atomic_write_json(args.out, result, indent=1)


if __name__ == "__main__":
    main()
