"""Evaluate the demo model with the semantic scorer, and time it on the CPU.

    python -m ditq.demo.evaluate [--model DIR] [--device cuda] [--t2i 200] [--edits 200] [--out results.json]
                                 [--guidance G] [--task-seed S]
    python -m ditq.demo.evaluate --timing [--threads 2] [--out timing.json]

The evaluation tasks are a fixed, seeded draw; their text-to-image prompts are excluded from training
(`heldout_t2i_prompts`), so the t2i accuracy is measured on prompts the model has never been trained on.
Edits are balanced over recolor (1 reference) and compose with 2, 3 and 4 references, all with fresh references.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ditq.demo import load_demo_pipeline
from ditq.demo.packing import pixels_to_pil
from ditq.demo.pipeline import DitqDemoPipeline
from ditq.demo.scenes import REFERENCE_CANVAS, Task, render_scenes, sample_task
from ditq.demo.scorer import score_image

__all__ = [
    "EVALUATION_SEED",
    "HELDOUT_T2I",
    "evaluate",
    "evaluation_tasks",
    "heldout_t2i_prompts",
    "time_cpu",
]

EVALUATION_SEED = 20260
HELDOUT_T2I = 300  # t2i tasks drawn for evaluation (and kept out of training); an evaluation uses the first N
EDIT_KINDS = (("recolor", 1), ("compose", 2), ("compose", 3), ("compose", 4))


def evaluation_tasks(num_t2i: int = 200, num_edits: int = 200, seed: int = EVALUATION_SEED) -> list[Task]:
    """The first `num_t2i` held-out t2i tasks, then `num_edits` edits cycling through `EDIT_KINDS`."""
    if num_t2i > HELDOUT_T2I:
        raise ValueError(f"--t2i: at most {HELDOUT_T2I} held-out prompts exist, asked for {num_t2i}")
    t2i_rng, edit_rng = np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])
    t2i = [sample_task(t2i_rng, "t2i", 0) for _ in range(HELDOUT_T2I)][:num_t2i]
    edits = [sample_task(edit_rng, *EDIT_KINDS[index % len(EDIT_KINDS)]) for index in range(num_edits)]
    return t2i + edits


@functools.cache
def heldout_t2i_prompts() -> frozenset[str]:
    return frozenset(task.prompt for task in evaluation_tasks(HELDOUT_T2I, 0))


def reference_images(task: Task) -> list[Image.Image]:
    if not task.references:
        return []
    return [pixels_to_pil(pixels) for pixels in render_scenes(list(task.references))]


def evaluate(
    pipe: DitqDemoPipeline,
    tasks: list[Task],
    steps: int = 20,
    guidance: float | None = None,
    batch_size: int = 100,
    seed: int = 0,
) -> dict[str, Any]:
    """Generate every task (batched by layout, seeded) and score it -> accuracies and per-task details."""
    groups: dict[tuple[str, int], list[int]] = defaultdict(list)
    for index, task in enumerate(tasks):
        groups[(task.kind, len(task.references))].append(index)
    details: list[dict[str, Any]] = [{} for _ in tasks]
    images: list[Image.Image | None] = [None] * len(tasks)
    for group_index, (_, members) in enumerate(sorted(groups.items())):
        for start in range(0, len(members), batch_size):
            chunk = members[start : start + batch_size]
            refs = [reference_images(tasks[i]) for i in chunk]
            generator = torch.Generator().manual_seed(seed + 1000 * group_index + start)
            output = pipe(
                prompt=[tasks[i].prompt for i in chunk],
                image=refs if refs[0] else None,
                num_inference_steps=steps,
                guidance_scale=guidance,
                generator=generator,
                return_dict=False,
            )
            for i, image in zip(chunk, output[0], strict=True):
                images[i] = image
                details[i] = {
                    "kind": tasks[i].kind,
                    "references": len(tasks[i].references),
                    "prompt": tasks[i].prompt,
                }
                details[i].update(score_image(image, tasks[i].expectation).as_dict())

    def accuracy(rows: list[dict[str, Any]]) -> float:
        return round(sum(row["correct"] for row in rows) / max(len(rows), 1), 4)

    by_layout: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in details:
        by_layout[f"{row['kind']}-{row['references']}ref"].append(row)
    edits = [row for row in details if row["kind"] != "t2i"]
    attributes = {
        name: round(sum(row["attributes"][name] for row in details) / len(details), 4)
        for name in details[0]["attributes"]
    }
    return {
        "t2i_accuracy": accuracy([row for row in details if row["kind"] == "t2i"]),
        "edit_accuracy": accuracy(edits),
        "by_layout": {
            key: {"n": len(rows), "accuracy": accuracy(rows)} for key, rows in sorted(by_layout.items())
        },
        "attribute_accuracy": attributes,
        "n_t2i": len(details) - len(edits),
        "n_edits": len(edits),
        "steps": steps,
        "guidance": guidance if guidance is not None else pipe.config["default_guidance_scale"],
        "details": details,
        "_images": images,
    }


def save_grid(images: list[Image.Image | None], path: Path, columns: int = 16) -> None:
    shown = [image for image in images if image is not None]
    side = shown[0].size[0]
    grid = Image.new("RGBA", (columns * side, -(-len(shown) // columns) * side))
    for index, image in enumerate(shown):
        grid.paste(image, ((index % columns) * side, (index // columns) * side))
    grid.save(path)


def _provenance() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "command": "python -m ditq.demo.evaluate " + " ".join(sys.argv[1:]),
        "git_commit": commit or None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }


def time_cpu(pipe: DitqDemoPipeline, threads: int, repeats: int = 3, steps: int = 20) -> dict[str, Any]:
    """Median wall seconds of a 64x64 t2i and of a 4-reference edit at `steps` steps, float32, on the CPU."""
    torch.set_num_threads(threads)
    task_t2i = evaluation_tasks(1, 0)[0]
    task_edit = evaluation_tasks(0, 4)[3]  # the 4-reference compose
    refs = reference_images(task_edit)
    results: dict[str, Any] = {"threads": threads, "steps": steps, "repeats": repeats}
    load_before = os.getloadavg()[0]
    for name, task, images in (("t2i_64", task_t2i, None), ("edit_4ref_64", task_edit, refs)):
        pipe(task.prompt, image=images, num_inference_steps=2)  # warm-up
        seconds, cpu_seconds = [], []
        for repeat in range(repeats):
            start, cpu_start = time.perf_counter(), time.process_time()
            generator = torch.Generator().manual_seed(repeat)
            pipe(task.prompt, image=images, num_inference_steps=steps, generator=generator)
            seconds.append(time.perf_counter() - start)
            cpu_seconds.append(time.process_time() - cpu_start)
        # cpu_s (this process's CPU time over all threads) does not grow when other processes share the cores:
        # on `threads` idle cores the wall time lies between cpu_s / threads and cpu_s.
        results[name] = {
            "median_s": round(statistics.median(seconds), 3),
            "all_s": [round(s, 3) for s in seconds],
            "median_cpu_s": round(statistics.median(cpu_seconds), 3),
        }
    results["load_average_1min_before"] = load_before
    results["load_average_1min_after"] = os.getloadavg()[0]
    results["reference_size"] = REFERENCE_CANVAS
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ditq.demo.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="demo pipeline directory (default: bundled)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--t2i", type=int, default=200)
    parser.add_argument("--edits", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=None, help="default: the pipeline's")
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="seed of the generation noise")
    parser.add_argument(
        "--task-seed",
        type=int,
        default=EVALUATION_SEED,
        help="seed of the task draw (default: the held-out evaluation set; another seed: a validation draw)",
    )
    parser.add_argument("--timing", action="store_true", help="time CPU generation instead of scoring")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    parser.add_argument("--grid", type=Path, default=None, help="save the generated images as one PNG grid")
    args = parser.parse_args(argv)
    pipe = load_demo_pipeline(args.model, device=args.device)
    pipe.set_progress_bar_config(disable=True)
    if args.timing:
        result: dict[str, Any] = time_cpu(pipe, args.threads, steps=args.steps)
    else:
        result = evaluate(
            pipe,
            evaluation_tasks(args.t2i, args.edits, args.task_seed),
            args.steps,
            args.guidance,
            args.batch_size,
            args.seed,
        )
        images = result.pop("_images")
        if args.grid is not None:
            save_grid(images, args.grid)
    result["provenance"] = _provenance()
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.write_text(text)
    summary = {key: value for key, value in result.items() if key != "details"}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
